"""Reading and writing safetensors checkpoints: sliced reads, atomic writes.

`SafetensorsDirSource(dir)` is a `TensorSource` over a Hugging Face checkpoint directory:
`model.safetensors.index.json` (sharded) or the `*.safetensors` files in it. `read(name,
dim, start, stop)` (and `read_box(name, [(start, stop) | None per dim])`) reads only that
slice from disk (`safe_open(...).get_slice`), so a rank
loads just its shard. Nothing is unpickled.

Writes go to a temporary sibling and are moved into place with `os.replace`, so a crash
never leaves a half-written file or directory under the final name.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"


class SafetensorsDirSource:
    """The tensors of a safetensors checkpoint directory, read lazily and by slice."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: not a checkpoint directory")
        self._handles: dict[str, Any] = {}
        index = self.path / INDEX
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.weight_map = {k: str(v) for k, v in weight_map.items()}
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"{self.path}: no *.safetensors files and no {INDEX}; the rule: a "
                    "safetensors checkpoint (save_pretrained(..., safe_serialization=True)); "
                    "fix: re-save the model with safetensors"
                )
            self.weight_map = {}
            for name in files:
                for key in self._open(name).keys():  # noqa: SIM118 (safe_open has no __iter__)
                    self.weight_map[key] = name

    def _open(self, file: str) -> Any:
        if file not in self._handles:
            full = (self.path / file).resolve()
            if self.path.resolve() not in full.parents:
                raise ValueError(f"{INDEX} points outside the checkpoint directory: {file!r}")
            self._handles[file] = safe_open(str(full), framework="pt")
        return self._handles[file]

    def keys(self) -> set[str]:
        if getattr(self, "_keys", None) is None:
            self._keys = set(self.weight_map)  # asked once per MoE parameter: build once
        return self._keys

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def _slice(self, name: str) -> Any:
        if name not in self.weight_map:
            raise KeyError(
                f"{self.path}: checkpoint has no tensor {name!r}; the rule: a "
                "checkpoint matching its config.json; fix: check the files"
            )
        return self._open(self.weight_map[name]).get_slice(name)

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        sl = self._slice(name)
        if dim is None:
            return sl[:]
        index = [slice(None)] * len(sl.get_shape())
        index[dim] = slice(start, stop)
        return sl[tuple(index)]

    def read_box(self, name: str, box: list[tuple[int, int] | None]) -> torch.Tensor:
        """Only the box `[start, stop)` per leading dim (None: whole) is read from disk."""
        sl = self._slice(name)
        index = [slice(None)] * len(sl.get_shape())
        for dim, span in enumerate(box):
            if span is not None:
                index[dim] = slice(*span)
        return sl[tuple(index)]

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> SafetensorsDirSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def save_tensors(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict | None = None
) -> None:
    """Write one safetensors file (contiguous, unshared copies) under a temporary name."""
    clean = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    save_file(clean, str(path), metadata={k: str(v) for k, v in (metadata or {}).items()})


def write_json(obj: Any, path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextmanager
def atomic_dir(out: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory next to `out`; on success it becomes `out`.

    `out` must not exist or be an empty directory (never overwrite a checkpoint).
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(
            f"{out} exists and is not an empty directory; fix: choose a new --out"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
