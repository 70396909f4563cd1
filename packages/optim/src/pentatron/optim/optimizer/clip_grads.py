"""Global grad-norm clipping across model-parallel ranks, each parameter counted once.

Which grads count (Megatron's `param_is_not_shared` and
`param_is_not_tensor_parallel_duplicate`): a param split over tp (`tensor_model_parallel`)
counts on every tp rank, since each holds a different part; one replicated over tp (norm
weights, biases of row-parallel layers) counts on tp rank 0 only; a tied embedding's second
copy (last pipeline stage, marked `shared=True`) does not count.

A set of grads is summed locally (squares, in fp32), then all-reduced over each group of its
`groups` in turn: over tp-pp (and, when the grads are dp shards, over dp-cp) for dense
params, over etp-ep-pp (and edp) for expert params. The groups of one set must be
orthogonal, so that together they cover each distinct grad exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pentatron.parallel_state import comm


def counts_for_norm(param: torch.nn.Parameter, tp_rank: int) -> bool:
    """Does this rank's copy of `param` enter the global norm? (see the module docstring)"""
    if getattr(param, "shared", False):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


@dataclass
class GradSet:
    """Grads whose norm is completed by all-reducing over `groups` (in order)."""

    grads: list[torch.Tensor]
    groups: Sequence[Any]


def _reduce(value: torch.Tensor, groups: Sequence[Any], op: Any) -> torch.Tensor:
    for group in groups:
        comm.all_reduce(value, op=op, group=group)
    return value


def global_grad_norm(sets: Iterable[GradSet], norm_type: float = 2.0) -> float:
    """L2 (or inf) norm of every grad of every set, over all the ranks of their groups."""
    total = torch.zeros((), dtype=torch.float32)
    for s in sets:
        device = s.grads[0].device if s.grads else torch.device("cpu")
        if norm_type == math.inf:
            local = torch.zeros((), dtype=torch.float32, device=device)
            for g in s.grads:
                local = torch.maximum(local, g.detach().abs().max().float())
            total = torch.maximum(total, _reduce(local, s.groups, comm.ReduceOp.MAX).cpu())
        else:
            local = torch.zeros((), dtype=torch.float32, device=device)
            for g in s.grads:
                local += (
                    torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32)
                    ** norm_type
                )
            total += _reduce(local, s.groups, comm.ReduceOp.SUM).cpu()
    if norm_type == math.inf:
        return float(total)
    return float(total) ** (1.0 / norm_type)


def clip_grads_by_norm(grads: Iterable[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale grads by max_norm / (total_norm + 1e-6) when that is below 1 (Megatron's rule)."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for g in grads:
            g.mul_(coeff)


def count_zeros(sets: Iterable[GradSet]) -> int:
    """Number of zero grad entries, counted like the norm (each parameter once)."""
    total = 0
    for s in sets:
        local = torch.zeros((), dtype=torch.float64)
        for g in s.grads:
            local += g.numel() - torch.count_nonzero(g).item()
        total += int(_reduce(local, s.groups, comm.ReduceOp.SUM).item())
    return total


def found_inf_anywhere(grads: Iterable[torch.Tensor], groups: Sequence[Any]) -> bool:
    """True if any grad on any rank of `groups` holds inf or nan (all-reduce MAX)."""
    flag = torch.zeros((), dtype=torch.float32)
    for g in grads:
        if not torch.isfinite(g).all():
            flag.fill_(1.0)
            break
    return bool(_reduce(flag, groups, comm.ReduceOp.MAX).item())
