"""Optimizer state saved through torch.distributed.checkpoint (DCP), reloadable at any dp size.

The distributed optimizer owns, per dp rank, a contiguous piece `[a, b)` of each param's
flattened range in the grad buffer (see `DistributedOptimizer`). A checkpoint describes whole
params instead, keyed by parameter name, so it does not depend on the dp layout:

    param/<name>/shape        int64 [ndim]         the param's shape, checked on load
    param/<name>/main         fp32  [numel]        the fp32 main param, flattened
    param/<name>/state/<key>  [numel] or []        inner optimizer state (Adam: exp_avg and
                                                   exp_avg_sq flat, step a scalar)
    group/<i>/<key>           float64 [] or [n]    numeric hyperparameters of param group i
    grad_scaler/<key>         float64 []           the loss scaler (fp16)

Each rank writes only the pieces it owns, as DCP chunks of the flat tensor at their offsets
within the param (no communication to gather them); replicated values are deduplicated by
DCP. On load each rank asks DCP for exactly its own pieces under the new layout, so
resharding from dp=4 to dp=2 (or to the non-distributed optimizer) is DCP's read planning.
Everything saved is a tensor: DCP loads tensors with `torch.load(weights_only=True)`, and no
value goes through DCP's pickled bytes path.

The fp32 main params are the master copy: loading them also rewrites the model params
(rounded to the model dtype; with the distributed optimizer, an all-gather over dp fills the
pieces other ranks own).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    TensorStorageMetadata,
)

from pentatron.parallel_state import comm

from .dcp_chunks import ChunkLoadPlanner, ChunkSavePlanner, GlobalChunks
from .optimizer.mixed_precision import MainParam, MixedPrecisionOptimizer

FORMAT_VERSION = 1


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the model/optimizer it is loaded into (names or shapes)."""


# --- flat pieces: 1-D chunks for the n-D chunk planners of dcp_chunks ------------------
class FlatPieces(GlobalChunks):
    """This rank's pieces of one flattened tensor of `numel` elements: (offset, 1-D view)."""

    def __init__(self, numel: int, pieces: Iterable[tuple[int, torch.Tensor]] = ()) -> None:
        super().__init__((numel,))
        for offset, t in pieces:
            self.add_piece(offset, t)

    @property
    def numel(self) -> int:
        return self.size[0]

    @property
    def pieces(self) -> list[tuple[int, torch.Tensor]]:
        return [(o[0], t) for o, t in self.chunks]

    def add_piece(self, offset: int, t: torch.Tensor) -> None:
        self.add((offset,), t)


# --- what this rank owns ----------------------------------------------------------------
def _param_names(optimizer: MixedPrecisionOptimizer) -> dict[torch.nn.Parameter, str]:
    chunks = optimizer.model_chunks
    names = {}
    for i, chunk in enumerate(chunks):
        module = getattr(chunk, "module", chunk)
        for name, p in module.named_parameters():
            names[p] = f"model{i}.{name}" if len(chunks) > 1 else name
    return names


def _offset_in_param(mp: MainParam) -> int:
    """Where `mp` starts in its param's flat range (its target is a view of the param)."""
    param, target = mp.model_param.data, mp.target
    if target.untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
        raise RuntimeError("main param target is not a view of its model param's storage")
    offset = int(target.storage_offset() - param.storage_offset())  # int | SymInt to int
    assert offset >= 0 and offset + target.numel() <= param.numel(), (offset, param.shape)
    return offset


@dataclass
class _Owned:
    """One named param: its shape and the (offset, MainParam) pieces this rank owns."""

    name: str
    shape: torch.Size
    pieces: list[tuple[int, MainParam]] = field(default_factory=list)


def _owned(optimizer: MixedPrecisionOptimizer) -> dict[str, _Owned]:
    names = _param_names(optimizer)
    out: dict[str, _Owned] = {}
    for mp in optimizer.main_params:
        name = names[mp.model_param]
        entry = out.setdefault(name, _Owned(name, mp.model_param.shape))
        entry.pieces.append((_offset_in_param(mp), mp))
    return out


def _all_names(optimizer: MixedPrecisionOptimizer) -> dict[str, torch.Size]:
    """Every param the optimizer trains (also those with no piece on this rank)."""
    names = _param_names(optimizer)
    return {
        names[p]: p.shape
        for chunk in optimizer.model_chunks
        for buffer in chunk.all_buffers
        for p in buffer.params
    }


def _numeric(value: Any) -> torch.Tensor | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return torch.tensor(float(value), dtype=torch.float64)
    if (
        isinstance(value, (tuple, list))
        and value
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        return torch.tensor([float(v) for v in value], dtype=torch.float64)
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return None


# --- state dicts ------------------------------------------------------------------------
def sharded_state_dict(optimizer: MixedPrecisionOptimizer, prefix: str = "") -> dict[str, Any]:
    """This rank's share of the checkpoint: `{key: Tensor | FlatPieces}` (see module doc).

    `prefix` keeps apart model-parallel ranks that hold different params under the same
    names (e.g. `f"tp{t}-pp{p}/"`); dp ranks must share it.
    """
    sd: dict[str, Any] = {f"{prefix}format_version": torch.tensor(FORMAT_VERSION)}
    state = optimizer.optimizer.state
    for name, owned in _owned(optimizer).items():
        key, numel = f"{prefix}param/{name}", owned.shape.numel()
        sd[f"{key}/shape"] = torch.tensor(list(owned.shape), dtype=torch.int64)
        sd[f"{key}/main"] = FlatPieces(numel, [(o, mp.main.view(-1)) for o, mp in owned.pieces])
        for offset, mp in owned.pieces:
            for k, v in state.get(mp.main, {}).items():
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"optimizer state {name}/{k} is a {type(v).__name__}")
                if v.dim() == 0:
                    sd[f"{key}/state/{k}"] = v.detach().clone()
                elif v.numel() == mp.main.numel():
                    flat = sd.setdefault(f"{key}/state/{k}", FlatPieces(numel))
                    flat.add_piece(offset, v.view(-1))
                else:
                    raise TypeError(
                        f"optimizer state {name}/{k} has shape {tuple(v.shape)}: only "
                        "per-element state (like the param) and scalars can be resharded"
                    )
    for i, group in enumerate(optimizer.optimizer.param_groups):
        for k, v in group.items():
            t = _numeric(v) if k != "params" else None
            if t is not None:
                sd[f"{prefix}group/{i}/{k}"] = t
    if optimizer.grad_scaler is not None:
        for k, v in optimizer.grad_scaler.state_dict().items():
            sd[f"{prefix}grad_scaler/{k}"] = torch.tensor(float(v), dtype=torch.float64)
    return sd


def save_optimizer(
    optimizer: MixedPrecisionOptimizer,
    path: str | os.PathLike[str],
    group: Any = None,
    *,
    prefix: str = "",
) -> None:
    """Collective over `group` (default: the world): write the optimizer's state to `path`.

    Atomic: DCP writes into `<path>.tmp`; after every rank's write has finished, rank 0 of
    `group` renames it to `path`. `path` must not exist yet; the filesystem is shared.
    """
    path = os.fspath(path)
    tmp = path + ".tmp"
    if os.path.exists(path):  # every rank checks, so every rank raises
        raise FileExistsError(f"{path} exists; fix: save each checkpoint to a new directory")
    first = dist.get_rank(group) == 0
    if first:
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
    comm.barrier(group)
    dcp.save(
        sharded_state_dict(optimizer, prefix),
        storage_writer=FileSystemWriter(tmp),
        planner=ChunkSavePlanner(),
        process_group=group,
    )
    comm.barrier(group)  # every rank's files are written before the rename
    if first:
        os.rename(tmp, path)
    comm.barrier(group)


def _check_matches(md: dict[str, Any], names: dict[str, torch.Size], prefix: str, strict: bool):
    saved = {
        k[len(prefix) + len("param/") : -len("/shape")]
        for k in md
        if k.startswith(prefix + "param/") and k.endswith("/shape")
    }
    missing = sorted(set(names) - saved)
    if missing:
        raise CheckpointMismatchError(
            f"checkpoint has no optimizer state for params {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}; fix: load a checkpoint of the same model "
            "(names from module.named_parameters())"
        )
    extra = sorted(saved - set(names))
    if strict and extra:
        raise CheckpointMismatchError(
            f"checkpoint holds params the model does not have: {extra[:5]}; fix: load it "
            "into the model it was saved from, or pass strict=False"
        )
    for name, shape in names.items():
        main = md.get(f"{prefix}param/{name}/main")
        if not isinstance(main, TensorStorageMetadata) or main.size[0] != shape.numel():
            raise CheckpointMismatchError(
                f"param {name}: checkpoint holds {None if main is None else main.size[0]} "
                f"elements, the model {shape.numel()} (shape {tuple(shape)}); fix: load a "
                "checkpoint of the same model configuration"
            )


def load_optimizer(
    optimizer: MixedPrecisionOptimizer,
    path: str | os.PathLike[str],
    group: Any = None,
    *,
    prefix: str = "",
    strict: bool = True,
) -> None:
    """Collective over `group`: load a `save_optimizer` checkpoint saved at any dp size.

    Restores main params (and through them the model params), the inner optimizer's state
    and numeric param-group hyperparameters, and the loss scaler. Raises
    `CheckpointMismatchError` (on every rank alike) when names or shapes do not match.
    """
    path = os.fspath(path)
    md = FileSystemReader(path).read_metadata().state_dict_metadata
    names = _all_names(optimizer)
    _check_matches(md, names, prefix, strict)
    owned = _owned(optimizer)
    shapes = {
        f"{prefix}param/{n}/shape": torch.zeros(len(s), dtype=torch.int64) for n, s in names.items()
    }
    dcp.load(
        shapes,
        storage_reader=FileSystemReader(path),
        planner=ChunkLoadPlanner(),
        process_group=group,
    )
    for key, saved in shapes.items():
        name = key[len(prefix) + len("param/") : -len("/shape")]
        if tuple(saved.tolist()) != tuple(names[name]):
            raise CheckpointMismatchError(
                f"param {name}: checkpoint shape {tuple(saved.tolist())}, model shape "
                f"{tuple(names[name])}; fix: load a checkpoint of the same model configuration"
            )

    sd: dict[str, Any] = {}
    new_state: dict[int, dict[str, torch.Tensor]] = {}  # by id(main)
    scalars: list[tuple[str, MainParam, str]] = []
    for name, entry in owned.items():
        key, numel = f"{prefix}param/{name}", entry.shape.numel()
        sd[f"{key}/main"] = FlatPieces(numel, [(o, mp.main.view(-1)) for o, mp in entry.pieces])
        for k in _state_keys(md, f"{key}/state/"):
            smd = _tensor_md(md, f"{key}/state/{k}")
            dtype = smd.properties.dtype
            if len(smd.size) == 0:
                sd.setdefault(f"{key}/state/{k}", torch.zeros((), dtype=dtype))
                scalars += [(f"{key}/state/{k}", mp, k) for _, mp in entry.pieces]
                continue
            flat = sd.setdefault(f"{key}/state/{k}", FlatPieces(numel))
            for offset, mp in entry.pieces:
                t = torch.zeros(mp.main.numel(), dtype=dtype, device=mp.main.device)
                flat.add_piece(offset, t)
                new_state.setdefault(id(mp.main), {})[k] = t.view_as(mp.main)
    groups = optimizer.optimizer.param_groups
    for i, g in enumerate(groups):
        for k in g:
            value = _numeric(g[k]) if f"{prefix}group/{i}/{k}" in md else None
            if value is not None:
                sd[f"{prefix}group/{i}/{k}"] = torch.zeros(
                    _tensor_md(md, f"{prefix}group/{i}/{k}").size, dtype=value.dtype
                )
    scaler_keys = [k for k in md if k.startswith(f"{prefix}grad_scaler/")]
    if optimizer.grad_scaler is not None:
        for k in scaler_keys:
            sd[k] = torch.zeros((), dtype=torch.float64)
    dcp.load(
        sd, storage_reader=FileSystemReader(path), planner=ChunkLoadPlanner(), process_group=group
    )

    for key, mp, k in scalars:
        new_state.setdefault(id(mp.main), {})[k] = sd[key].clone()
    _load_inner(optimizer, new_state, sd, prefix)
    if optimizer.grad_scaler is not None and scaler_keys:
        optimizer.grad_scaler.load_state_dict(
            {k[len(f"{prefix}grad_scaler/") :]: sd[k].item() for k in scaler_keys}
        )
    _write_main_params_to_model(optimizer)


def _tensor_md(md: Mapping[str, Any], key: str) -> TensorStorageMetadata:
    """The metadata of `key`, a tensor (everything `save_optimizer` writes is one)."""
    entry = md[key]
    if not isinstance(entry, TensorStorageMetadata):
        raise CheckpointMismatchError(
            f"checkpoint entry {key} holds bytes, not a tensor; fix: load a checkpoint "
            "written by save_optimizer"
        )
    return entry


def _state_keys(md: Iterable[str], head: str) -> list[str]:
    return sorted(k[len(head) :] for k in md if k.startswith(head))


def _load_inner(
    optimizer: MixedPrecisionOptimizer,
    new_state: dict[int, dict[str, torch.Tensor]],
    sd: dict[str, Any],
    prefix: str,
) -> None:
    inner = optimizer.optimizer
    current = inner.state_dict()
    index = {id(t): i for i, t in enumerate(t for g in inner.param_groups for t in g["params"])}
    groups = current["param_groups"]
    if len(groups) != len(inner.param_groups):
        raise AssertionError("inner optimizer state_dict has an unexpected group count")
    for i, g in enumerate(groups):
        for k, v in list(g.items()):
            t = sd.get(f"{prefix}group/{i}/{k}")
            if t is None or k == "params":
                continue
            if isinstance(v, torch.Tensor):
                g[k] = t.to(v.dtype)
            elif isinstance(v, (tuple, list)):
                g[k] = type(v)(t.tolist())
            else:
                g[k] = type(v)(t.item())
    state = {index[i]: s for i, s in new_state.items()}
    inner.load_state_dict({"state": state, "param_groups": groups})


@torch.no_grad()
def _write_main_params_to_model(optimizer: MixedPrecisionOptimizer) -> None:
    for mp in optimizer.main_params:
        if mp.owns_storage:
            mp.target.copy_(mp.main.view_as(mp.target))
    if optimizer.is_sharded:
        for chunk in optimizer.model_chunks:
            chunk.start_param_sync(async_op=False)
            chunk.finish_param_sync()
