"""Expert capacity and token dropping (Megatron's get_capacity / token-drop policies).

An expert takes at most `capacity = ceil(T * topk / E * capacity_factor)` of this rank's T
tokens. Over capacity, policy "probs" keeps the tokens with the highest routing prob,
"position" the earliest tokens (index in s-major order); ties in prob keep the earlier
token, so the result is deterministic.
"""

from __future__ import annotations

import math

import torch

DROP_POLICIES = ("probs", "position")


def get_capacity(
    num_tokens: int,
    num_experts: int,
    topk: int,
    capacity_factor: float,
    min_capacity: int | None = None,
) -> int:
    """Tokens one expert may take: ceil(num_tokens * topk / num_experts * capacity_factor)."""
    capacity = math.ceil((num_tokens * topk / num_experts) * capacity_factor)
    if min_capacity is not None:
        capacity = max(capacity, min_capacity)
    return capacity


def capacity_mask(
    probs: torch.Tensor, routing_map: torch.Tensor, capacity: int, policy: str
) -> torch.Tensor:
    """`[T, E]` bool: per expert (column) the `capacity` tokens the policy keeps.

    Routed tokens rank first (by prob or by position), then unrouted ones by position, so
    with padding an expert's spare slots go to the earliest unrouted tokens.
    """
    if policy not in DROP_POLICIES:
        raise ValueError(
            f"moe_token_drop_policy={policy!r}: one of {DROP_POLICIES}; fix: use 'probs' "
            "(keep the most probable tokens) or 'position' (keep the first tokens)"
        )
    num_tokens = probs.shape[0]
    if capacity >= num_tokens:
        return torch.ones_like(routing_map, dtype=torch.bool)
    if policy == "probs":  # probs >= 0, so -1 puts unrouted tokens last
        key = torch.where(routing_map, probs.detach(), torch.full_like(probs, -1.0))
    else:
        key = routing_map.to(torch.float32)
    order = torch.sort(key, dim=0, descending=True, stable=True).indices[:capacity]
    return torch.zeros_like(routing_map, dtype=torch.bool).scatter(0, order, True)


def drop_tokens(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    topk: int,
    capacity_factor: float,
    policy: str = "probs",
    pad_to_capacity: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Enforce expert capacity on `[T, E]` probs (zero off the route) and routing map.

    Returns (probs, routing_map) with the dropped assignments zeroed / False. With
    `pad_to_capacity` the map holds exactly min(capacity, T) tokens per expert (padding
    slots have prob 0), as the fixed-shape dispatch needs.
    """
    num_tokens, num_experts = probs.shape
    capacity = get_capacity(num_tokens, num_experts, topk, capacity_factor)
    keep = capacity_mask(probs, routing_map, capacity, policy)
    final_map = keep if pad_to_capacity else torch.logical_and(routing_map, keep)
    return probs * final_map, final_map
