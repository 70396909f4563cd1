"""Permute tokens by expert and combine them back with their routing probabilities.

`permute` orders the copies of the tokens expert-major (expert 0's tokens first, each
expert's tokens in token order), the layout the experts and the all-to-all need;
`unpermute` is its adjoint: each copy is scaled by its probability and summed back into
its token's row.

    tokens [T, h], routing_map [T, E] bool -> permute -> [N, h], N = routing_map.sum()
    [N, h] -> unpermute(probs [T, E]) -> [T, h]

With `capacity` (padding to capacity, Megatron's drop-and-pad) every expert gets exactly
`capacity` rows: its routed tokens first, then other tokens (token 0 once they run out)
weighted 0, so padding rows change no output and get no gradient from the combine.
"""

from __future__ import annotations

import torch


def _check(tokens: torch.Tensor, routing_map: torch.Tensor) -> None:
    if tokens.dim() != 2:
        raise ValueError(
            f"tokens has shape {tuple(tokens.shape)}; the rule: permute takes [T, h] "
            "tokens; fix: flatten [s, b, h] to [s * b, h]"
        )
    if routing_map.dtype != torch.bool or routing_map.dim() != 2:
        raise ValueError(
            f"routing_map is {routing_map.dtype} {tuple(routing_map.shape)}; the rule: a "
            "[T, E] bool mask (True: token goes to expert); fix: pass the router's map"
        )
    if routing_map.size(0) != tokens.size(0):
        raise ValueError(
            f"routing_map has {routing_map.size(0)} rows for {tokens.size(0)} tokens; the "
            "rule: one row per token; fix: route the same tokens you permute"
        )


def sorted_token_indices(routing_map: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """`[N]` token index of each permuted row, expert-major (`capacity`: rows per expert)."""
    if capacity is None:
        num_tokens = routing_map.size(0)
        ids = torch.arange(num_tokens, device=routing_map.device)
        return ids.expand(routing_map.size(1), -1).masked_select(routing_map.t())
    if int(routing_map.sum(0).max()) > capacity:
        raise ValueError(
            f"an expert has {int(routing_map.sum(0).max())} routed tokens, more than "
            f"capacity={capacity}; the rule: the router drops tokens over capacity before "
            "padding; fix: pass the router's capacity-limited routing_map"
        )
    # Stable descending sort puts the routed tokens first, in token order, per expert.
    order = routing_map.t().to(torch.int8).argsort(dim=-1, descending=True, stable=True)
    if capacity > order.size(1):  # more slots than tokens: pad with token 0 (weight 0)
        order = torch.cat([order, order.new_zeros((order.size(0), capacity - order.size(1)))], 1)
    return order[:, :capacity].reshape(-1)


def permute(
    tokens: torch.Tensor, routing_map: torch.Tensor, capacity: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, h]` -> (`[N, h]` expert-major copies, `[N]` their token indices)."""
    _check(tokens, routing_map)
    indices = sorted_token_indices(routing_map, capacity)
    return tokens.index_select(0, indices), indices


def permuted_probs(
    probs: torch.Tensor, routing_map: torch.Tensor, indices: torch.Tensor, capacity: int | None
) -> torch.Tensor:
    """`[N]` probability of each permuted row (0 on padding rows)."""
    if probs.shape != routing_map.shape:
        raise ValueError(
            f"probs {tuple(probs.shape)} and routing_map {tuple(routing_map.shape)} differ; "
            "the rule: both are [T, E] from the router; fix: pass the router's outputs"
        )
    if capacity is None:
        return probs.t().masked_select(routing_map.t())
    experts = torch.arange(probs.size(1), device=probs.device).repeat_interleave(capacity)
    slots = torch.arange(capacity, device=probs.device).repeat(probs.size(1))
    routed = slots < routing_map.sum(0).repeat_interleave(capacity)  # padding rows: weight 0
    return probs[indices, experts] * routed


def unpermute(
    permuted: torch.Tensor,
    indices: torch.Tensor,
    num_tokens: int,
    probs: torch.Tensor | None = None,
    routing_map: torch.Tensor | None = None,
    capacity: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`[N, h]` -> `[T, h]`: sum of each token's copies, weighted by `probs` when given.

    The weighting and the sum run in the wider of `permuted`'s and `probs`' dtypes (bf16
    expert outputs with fp32 probs: in fp32, as Megatron's unpermute); the result is cast
    to `out_dtype` (None: `permuted`'s dtype)."""
    in_dtype = permuted.dtype
    if permuted.size(0) != indices.numel():
        raise ValueError(
            f"{permuted.size(0)} rows for {indices.numel()} indices; the rule: unpermute "
            "the rows permute produced; fix: pass permute's indices"
        )
    if probs is not None:
        if routing_map is None:
            raise ValueError(
                "unpermute got probs without routing_map; the rule: the weights of the "
                "permuted rows need both; fix: pass the router's routing_map with its probs"
            )
        weights = permuted_probs(probs, routing_map, indices, capacity)
        wide = torch.promote_types(permuted.dtype, weights.dtype)
        permuted = permuted.to(wide) * weights.unsqueeze(-1).to(wide)
    out = permuted.new_zeros((num_tokens, permuted.size(-1)))
    return out.index_add(0, indices, permuted).to(out_dtype or in_dtype)


def sort_chunks(x: torch.Tensor, split_sizes: list[int], order: list[int]) -> torch.Tensor:
    """Split `x` along dim 0 by `split_sizes` and concatenate the chunks in `order`."""
    chunks = torch.split(x, split_sizes, dim=0)
    return torch.cat([chunks[i] for i in order], dim=0)
