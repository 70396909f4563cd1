"""Gradient fix-ups that tensor parallelism needs after backward.

With sequence parallelism, parameters that act on the `[s/t, b, h]` shard (norm weights, the
bias of a row-parallel layer) see only s/t of the tokens on each rank, so their grads are
partial sums over tp. Megatron all-reduces them in `finalize_model_grads`; a user of these
layers without Pentatron's optimizer calls `sync_sequence_parallel_grads` instead.
"""

from __future__ import annotations

from typing import Any

import torch

from pentatron.parallel_state import comm

from .utils import group_size, resolve_group


def mark_sequence_parallel(*params: torch.nn.Parameter) -> None:
    """Mark parameters used on the sequence shard (e.g. a LayerNorm's weight and bias)."""
    for p in params:
        # torch stubs lack .sequence_parallel
        p.sequence_parallel = True  # type: ignore[attr-defined]


# Elements of grads joined into one all-reduce: norms' grads are tiny and join into one, but
# duplicated linears (MLA's down-projections, about 15M elements a layer at DeepSeek-V3's
# size) would make one joined copy as large as a stage's share of them.
BUCKET_ELEMENTS = 1 << 24


def sync_sequence_parallel_grads(
    module: torch.nn.Module, tp_group: Any = None, bucket_elements: int = BUCKET_ELEMENTS
) -> int:
    """All-reduce(tp) the grads of parameters marked `sequence_parallel`, joined into as
    few collectives as `bucket_elements` per copy allows (a grad at least that large is
    reduced in place, alone).

    Uses `main_grad` when a parameter has one. Returns the number of parameters reduced.
    """
    group = resolve_group(tp_group)
    marked = [_grad_of(p) for p in module.parameters() if getattr(p, "sequence_parallel", False)]
    grads = [g for g in marked if g is not None]
    if not grads or group_size(group) == 1:
        return len(grads)
    for bucket in _buckets(grads, bucket_elements):
        if len(bucket) == 1 and bucket[0].is_contiguous():
            comm.all_reduce(bucket[0], group=group)
            continue
        flat = torch.cat([g.reshape(-1) for g in bucket])
        comm.all_reduce(flat, group=group)
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(part.view_as(g))
    return len(grads)


def _buckets(grads: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of `grads` of at most `limit` elements (a larger grad alone)."""
    out: list[list[torch.Tensor]] = []
    size = limit
    for g in grads:
        if size + g.numel() > limit:
            out.append([])
            size = 0
        out[-1].append(g)
        size += g.numel()
    return out


def _grad_of(p: torch.nn.Parameter) -> torch.Tensor | None:
    # torch stubs lack DDP's .main_grad
    return p.main_grad if hasattr(p, "main_grad") else p.grad  # type: ignore[attr-defined]
