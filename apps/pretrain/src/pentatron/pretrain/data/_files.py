"""Small file helpers for the data pipeline: atomic writes, an inter-process lock, hashing.

Every file the data pipeline writes goes through `atomic_write` (a temp file in the same
folder, then `os.replace`), so a reader never sees half a file and a killed writer leaves
nothing behind but a stray temp file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temp file next to `path`; on success `os.replace` it onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def save_npy(path: str | os.PathLike[str], array: np.ndarray) -> None:
    with atomic_write(path) as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)


def load_npy(path: str | os.PathLike[str], mmap: bool = True) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise ValueError(f"cannot read index cache file {path}: {exc}") from None


def save_json(path: str | os.PathLike[str], obj: Any) -> None:
    with atomic_write(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)


def config_hash(description: Any) -> str:
    """md5 of the canonical JSON of `description` (Megatron keys its caches the same way)."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.md5(text.encode()).hexdigest()


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Exclusive inter-process lock held on `path` (created if missing) for the block."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        if fcntl is not None:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def build_once(lock_path: str | os.PathLike[str], is_built, build, group=None) -> None:
    """Run `build()` exactly once across processes unless `is_built()` already holds.

    With a torch.distributed `group`, its first rank builds first and the group waits at a
    barrier; then (and without a group) every process takes the file lock and builds only
    if the result is still missing, so ranks on machines without a shared file system each
    build their own copy, and ranks sharing one build it once.
    """
    synced = False  # the ranks of `group` take part (torch.distributed is imported)
    if group is not None:
        import torch.distributed as dist

        synced = dist.is_initialized()
    error: BaseException | None = None
    if synced and dist.get_rank(group) == 0 and not is_built():
        try:
            with file_lock(lock_path):
                if not is_built():
                    build()
        except Exception as exc:  # reach the barrier anyway, so no rank waits for a dead builder
            error = exc
    if synced:
        dist.barrier(group=group)
    if error is not None:
        raise error
    if not is_built():
        with file_lock(lock_path):
            if not is_built():
                build()
