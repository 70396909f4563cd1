"""Model params as chunks of their global tensors (keys `model/<global name>[/gate|/up]`).

Save: dp rank 0 of each model-parallel group writes its tp shards' rectangles (see
`rectangles`); with FSDP2 every dp rank writes the rows of the shards it holds. Load: every
rank reads the rectangles of its own shards, at any tp / pp / vpp / dp layout and with or
without FSDP2; vocabulary padding rows load where the padded size is the saved one, else
are set to zero.

A param is a plain tensor (DDP) or an FSDP2 `DTensor` whose global shape is the tp shard;
its rectangles then index `local_tensor(param)`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from pentatron.optim import FSDP2DataParallel, local_tensor
from pentatron.optim.dcp_chunks import GlobalChunks
from pentatron.parallel_state import ProcessGrid

from .rectangles import VOCAB_PADDING, Rect, param_rects, restrict_rows, shard_info

PREFIX = "model/"


def iter_param_rects(
    chunks: Sequence[Any], grid: ProcessGrid
) -> Iterator[tuple[torch.nn.Parameter, list[Rect]]]:
    """Every trainable param of this rank's chunks with its rectangles (`Rect.writer`
    already says whether this rank writes it: one writer per value, see `rectangles`).
    The rectangles index `local_tensor(param)`."""
    tp_rank, tp_size = grid.rank("tp"), grid.size("tp")
    for chunk in chunks:
        info = shard_info(chunk, tp_rank, tp_size, grid)
        model = getattr(chunk, "module", chunk)
        fsdp2 = isinstance(chunk, FSDP2DataParallel)
        for name, p in model.named_parameters():
            rects = param_rects(name, tuple(p.shape), info)
            if fsdp2:  # this rank holds rows [lo, hi) of the tp shard
                rows = chunk.held_rows(p)
                rects = [r for r in (restrict_rows(x, *rows) for x in rects) if r is not None]
            yield p, rects


def iter_buffer_rects(
    chunks: Sequence[Any], grid: ProcessGrid
) -> Iterator[tuple[torch.Tensor, list[Rect]]]:
    """Persistent buffers (in the state dict, not params: e.g. MoE routers' expert_bias),
    replicated over tp and dp like norms."""
    tp_rank, tp_size = grid.rank("tp"), grid.size("tp")
    for chunk in chunks:
        info = shard_info(chunk, tp_rank, tp_size, grid)
        model = getattr(chunk, "module", chunk)
        persistent = set(model.state_dict(keep_vars=True))
        for name, b in model.named_buffers():
            if name in persistent and b.is_floating_point():
                yield b, param_rects(name, tuple(b.shape), info)


def add_rect(sd: dict[str, Any], prefix: str, rect: Rect, tensor: torch.Tensor) -> None:
    """Register `tensor[rect.local]` as a chunk of `prefix + rect.key` in `sd`."""
    entry = sd.setdefault(prefix + rect.key, GlobalChunks(rect.global_shape))
    if entry.size != rect.global_shape:
        raise ValueError(f"{rect.key}: global shapes {entry.size} and {rect.global_shape}")
    entry.add(rect.offsets, tensor[rect.local])


def _all_rects(chunks, grid):
    yield from iter_param_rects(chunks, grid)
    yield from iter_buffer_rects(chunks, grid)


def model_save_entries(chunks: Sequence[Any], grid: ProcessGrid) -> dict[str, Any]:
    """`{model/<key>: GlobalChunks}` of the rectangles this rank writes."""
    sd: dict[str, Any] = {}
    for p, rects in _all_rects(chunks, grid):
        for rect in rects:
            if rect.writer:
                add_rect(sd, PREFIX, rect, local_tensor(p.detach()))
    return sd


def model_keys(chunks: Sequence[Any], grid: ProcessGrid) -> set[str]:
    """The `model/<key>` names this rank's params and buffers load from (without the
    vocabulary-padding rows, which a checkpoint of another padded size cannot hold)."""
    return {
        PREFIX + r.key
        for _, rects in _all_rects(chunks, grid)
        for r in rects
        if not r.key.endswith(VOCAB_PADDING)
    }


def padding_to_skip(chunks: Sequence[Any], grid: ProcessGrid, saved: dict[str, Any]) -> set[str]:
    """The vocabulary-padding keys this rank cannot load from a checkpoint whose tensor
    metadata is `saved`: absent, or of another padded size (another tp or
    --make-vocab-size-divisible-by). Those rows, and their optimizer state, start at zero."""
    out = set()
    for _, rects in _all_rects(chunks, grid):
        for r in rects:
            meta = saved.get(PREFIX + r.key)
            if r.key.endswith(VOCAB_PADDING) and (
                meta is None or tuple(meta.size) != r.global_shape
            ):
                out.add(r.key)
    return out


@torch.no_grad()
def model_load_entries(
    chunks: Sequence[Any], grid: ProcessGrid, skip: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """`{model/<key>: GlobalChunks}` of views into this rank's params (filled by DCP).

    Zeroes the params first, so rows no rectangle covers (vocabulary padding in `skip`)
    end as zeros. A tensor whose keys (`Rect.key`) are all in `skip` (missing from a
    checkpoint loaded leniently, --dist-ckpt-strictness) keeps its values.
    """
    sd: dict[str, Any] = {}
    for p, rects in _all_rects(chunks, grid):
        kept = [r for r in rects if r.key not in skip]
        skipped_padding_only = all(r.key.endswith(VOCAB_PADDING) for r in rects if r not in kept)
        if not rects or (not kept and not skipped_padding_only):
            continue
        local = local_tensor(p.data)  # a view: DCP's writes reach the DTensor's shard
        local.zero_()
        for rect in kept:
            add_rect(sd, PREFIX, rect, local)
    return sd
