"""Global grad-norm clipping across model-parallel ranks, each parameter counted once.

Which grads count (Megatron's `param_is_not_shared` and
`param_is_not_tensor_parallel_duplicate`): a param split over tp (`tensor_model_parallel`)
counts on every tp rank, since each holds a different part; one replicated over tp (norm
weights, biases of row-parallel layers) counts on tp rank 0 only; a tied embedding's second
copy (last pipeline stage, marked `shared=True`) does not count.

A set of grads is summed locally (squares of per-grad norms from `torch._foreach_norm`, in
fp32, on the grads' device), then all-reduced over each group of its
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

from pentatron.parallel_state import comm, current_device


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


def _device_of(sets: list[GradSet]) -> torch.device:
    """Where the statistics are reduced: the grads' device (the grid's when a rank holds no
    grad of a set: it still takes part in the all-reduce, on the compute device)."""
    for s in sets:
        for g in s.grads:
            return g.device
    return current_device()


def _local_norms(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Per-grad norms in fp32, `[len(grads)]`, with one multi-tensor kernel per dtype."""
    norms: list[torch.Tensor] = []
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g.detach())
    for group in by_dtype.values():
        norms += torch._foreach_norm(group, norm_type, dtype=torch.float32)
    return torch.stack(norms)


def global_grad_norm_tensor(sets: Iterable[GradSet], norm_type: float = 2.0) -> torch.Tensor:
    """The global norm as a 0-dim fp32 tensor on the grads' device (no host read)."""
    sets = list(sets)
    device = _device_of(sets)
    inf = norm_type == math.inf
    total = torch.zeros((), dtype=torch.float32, device=device)
    for s in sets:
        local = torch.zeros((), dtype=torch.float32, device=device)
        if s.grads:
            norms = _local_norms(s.grads, norm_type)
            local = norms.max() if inf else norms.pow(norm_type).sum()
        local = _reduce(local, s.groups, comm.ReduceOp.MAX if inf else comm.ReduceOp.SUM)
        total = torch.maximum(total, local) if inf else total + local
    return total if inf else total.pow(1.0 / norm_type)


def global_grad_norm(sets: Iterable[GradSet], norm_type: float = 2.0) -> float:
    """L2 (or inf) norm of every grad of every set, over all the ranks of their groups
    (one host read)."""
    return float(global_grad_norm_tensor(sets, norm_type))


def agree_has_experts(local: bool, grid: Any = None) -> bool:
    """Whether any rank holds expert params, agreed over the grid's host group once.

    A pipeline rank whose stages hold only dense layers (DeepSeek's first dense layers, an
    empty stage) has none, yet the expert norm's all-reduces span the pipeline: every rank
    must issue them alike. `grid` None: the default grid, if any; one process: `local`."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return local
    if grid is None:
        from pentatron.parallel_state import get_default_grid, model_parallel_is_initialized

        if not model_parallel_is_initialized():
            return local
        grid = get_default_grid()
    flag = torch.tensor([int(local)], dtype=torch.int32)  # host-side: the host group's
    comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=grid.host_group)
    return bool(flag.item())


def clip_grads_by_norm(grads: Iterable[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale grads by max_norm / (total_norm + 1e-6) when that is below 1 (Megatron's rule)."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        grads = list(grads)
        if grads:
            torch._foreach_mul_(grads, coeff)


def count_zeros(sets: Iterable[GradSet]) -> int:
    """Number of zero grad entries, counted like the norm (each parameter once)."""
    sets = list(sets)
    device = _device_of(sets)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for s in sets:
        local = torch.zeros((), dtype=torch.float64, device=device)
        for g in s.grads:
            local += g.numel() - torch.count_nonzero(g)
        total += _reduce(local, s.groups, comm.ReduceOp.SUM)
    return int(total)


def found_inf_anywhere(grads: Iterable[torch.Tensor], groups: Sequence[Any]) -> bool:
    """True if any grad on any rank of `groups` holds inf or nan (all-reduce MAX)."""
    return unscale_and_find_inf(grads, 1.0, groups, unscale=False)


def unscale_and_find_inf(
    grads: Iterable[torch.Tensor], inv_scale: float, groups: Sequence[Any], unscale: bool = True
) -> bool:
    """Multiply every grad by `inv_scale` in place (fp16 loss scaling) and say whether any
    grad on any rank of `groups` holds inf or nan: AMP's fused multi-tensor kernel, one flag
    on the grads' device, one all-reduce (MAX), one host read."""
    grads = list(grads)
    device = grads[0].device if grads else current_device()
    found = torch.zeros(1, dtype=torch.float32, device=device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    if unscale:
        inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
    elif grads:
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
        found = (~finite).float().reshape(1)
    return bool(_reduce(found, groups, comm.ReduceOp.MAX).item())
