"""--log-params-norm: the L2 norm of all parameters, each counted once across the grid.

The same count and reduction as the optimizer's grad norm (`pentatron.optim`'s
`counts_for_norm`, `GradSet`, `global_grad_norm`), applied to the optimizer's fp32 main
params instead of their grads: tp-split params count on every tp rank, tp-replicated ones
on tp rank 0, the tied embedding's second copy not at all; the sum of squares is all-reduced
over the optimizer's groups (tp-pp, plus dp-cp where the main params are dp shards: the
distributed optimizer, FSDP2; experts over etp-ep-pp and edp). Collective on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from pentatron.optim import (
    FSDP2Optimizer,
    GradSet,
    counts_for_norm,
    global_grad_norm,
    is_expert_param,
    local_tensor,
)


def _main_params(optimizer: Any) -> list[tuple[torch.nn.Parameter, torch.Tensor, bool]]:
    """(model param, the fp32 tensor the optimizer updates for it, expert?) of this rank."""
    if isinstance(optimizer, FSDP2Optimizer):  # the params are this rank's fp32 dp shards
        return [(p, local_tensor(p.detach()), is_expert_param(p)) for p in optimizer.params]
    # MixedPrecisionOptimizer / DistributedOptimizer: fp32 main params (dp shards under ZeRO)
    return [(mp.model_param, mp.main.detach(), mp.expert) for mp in optimizer.main_params]


def params_norm(optimizer: Any, has_experts: bool) -> float:
    """L2 norm of every parameter of the model, the same value on every rank.

    `has_experts` must be the same on every rank (the app passes `bool(args.num_experts)`):
    it decides whether the expert norm's all-reduces run."""
    stats = optimizer.stats
    entries = _main_params(optimizer)
    dense = [t for p, t, expert in entries if not expert and counts_for_norm(p, stats.tp_rank)]
    sets = [GradSet(dense, stats.dense)]
    if has_experts:
        expert = [t for p, t, e in entries if e and counts_for_norm(p, stats.expert_tp_rank)]
        sets.append(GradSet(expert, stats.expert))
    return global_grad_norm(sets)
