"""Aux-loss-free load balancing (DeepSeek-V3): nudge each router's expert bias after the
optimizer step towards under-loaded experts.

    load = all-reduce(group) of the tokens routed to each expert since the last update
    expert_bias += rate * sign(mean(load) - load)

The bias only changes which experts are chosen, never the probs. Every rank of `group`
(the app passes grid.group("tp-dp-cp"): all ranks holding the same layers) applies the
same update to the same bias, so the biases stay identical without a broadcast.

The counts are the assignments kept after capacity dropping, without padding slots (see
`router.py`). A skipped step (non-finite loss or grads) must call
`reset_expert_bias_counts` instead, so its counts do not leak into the next update.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

import torch

from pentatron.parallel_state import comm

if TYPE_CHECKING:
    from ..config import TransformerConfig


class _BiasRouter(Protocol):
    """A router (TopKRouter) built with `moe_router_enable_expert_bias`: both buffers set."""

    config: TransformerConfig
    expert_bias: torch.Tensor
    local_tokens_per_expert: torch.Tensor


def _has_expert_bias(module: torch.nn.Module) -> TypeGuard[_BiasRouter]:
    return (
        getattr(module, "expert_bias", None) is not None
        and getattr(module, "local_tokens_per_expert", None) is not None
    )


def _bias_routers(model_chunks: Any) -> list[_BiasRouter]:
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    return [m for chunk in chunks for m in chunk.modules() if _has_expert_bias(m)]


@torch.no_grad()
def update_expert_bias(model_chunks: Any, group: Any = None) -> int:
    """Apply the bias rule to every router with an expert bias; returns how many.

    One all-reduce(group) of the stacked counts `[routers, E]` (fp32); then the counts are
    zeroed. Call once per step, after the optimizer step, on every rank of `group`.
    """
    routers = _bias_routers(model_chunks)
    if not routers:
        return 0
    counts = torch.stack([r.local_tokens_per_expert.float() for r in routers])
    distributed = group is not None and torch.distributed.is_initialized()
    if distributed and torch.distributed.get_world_size(group) > 1:
        comm.all_reduce(counts, group=group)
    offset = counts.mean(dim=-1, keepdim=True) - counts
    for router, delta in zip(routers, torch.sign(offset)):
        rate = router.config.moe_router_bias_update_rate
        router.expert_bias.data = router.expert_bias.data.float() + rate * delta
    return reset_expert_bias_counts(routers)


@torch.no_grad()
def reset_expert_bias_counts(model_chunks: Any) -> int:
    """Zero every bias router's counts without touching the bias (a skipped step); returns
    how many routers. Local: no communication."""
    routers = _bias_routers(model_chunks)
    for router in routers:
        router.local_tokens_per_expert.zero_()
    return len(routers)
