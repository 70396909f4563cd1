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


def sync_sequence_parallel_grads(module: torch.nn.Module, tp_group: Any = None) -> int:
    """All-reduce(tp) the grads of parameters marked `sequence_parallel`, in one collective.

    Uses `main_grad` when a parameter has one. Returns the number of parameters reduced.
    """
    group = resolve_group(tp_group)
    marked = [_grad_of(p) for p in module.parameters() if getattr(p, "sequence_parallel", False)]
    grads = [g for g in marked if g is not None]
    if not grads or group_size(group) == 1:
        return len(grads)
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
    return len(grads)


def _grad_of(p: torch.nn.Parameter) -> torch.Tensor | None:
    # torch stubs lack DDP's .main_grad
    return p.main_grad if hasattr(p, "main_grad") else p.grad  # type: ignore[attr-defined]
