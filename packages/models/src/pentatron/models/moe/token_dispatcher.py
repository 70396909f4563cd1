"""Token dispatchers: move each rank's routed tokens to the ranks holding their experts and
bring the expert outputs back (Megatron's MoEAllGatherTokenDispatcher and
MoEAlltoAllTokenDispatcher).

Both work on this rank's tokens `[T, h]` (T = s/(t*cp) * b), the router's `probs [T, E]`
and `routing_map [T, E]`, and return from `dispatch` the expert input `[N, h]` sorted by
local expert with `tokens_per_expert` (E_local ints) plus a context for `combine`, which
returns `[T, h]`: each token's expert outputs summed with their probabilities. Partial sums
are weighted and reduced in the router dtype (the probs' dtype, `moe_router_dtype`) when it
is wider than the tokens', and cast back to the tokens' dtype, as Megatron's dispatchers.

allgather (group "etp-ep", n = etp * ep ranks):
    [T, h] -> all-gather -> [n T, h] -> keep tokens of local experts -> experts
    -> unpermute(probs) [n T, h] (partial over the group) -> reduce-scatter -> [T, h]
alltoall (groups "ep" and "etp"):
    [T, h] -> permute by expert [N, h] -> all-to-all(ep, split by destination)
    -> all-gather(etp, uneven) -> sort by local expert -> experts -> the reverse
    (sort back, reduce-scatter(etp), all-to-all(ep), unpermute(probs)) -> [T, h]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pentatron.parallel_state import comm
from pentatron.tp_layers import (
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from .capacity import get_capacity
from .permute import permute, sort_chunks, unpermute


def _size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: Any) -> int:
    return 0 if group is None else dist.get_rank(group)


def expert_capacity(num_tokens: int, config: Any) -> int | None:
    """Megatron's capacity per expert: ceil(T * topk / E * capacity_factor) (None: no cap)."""
    cf = config.moe_expert_capacity_factor
    if cf is None:
        return None
    return get_capacity(num_tokens, config.num_moe_experts, config.moe_router_topk, cf)


@dataclass
class MoEGroups:
    """The expert-grid groups a MoE layer uses (None everywhere: one process)."""

    ep: Any = None
    etp: Any = None
    etp_ep: Any = None
    tp: Any = None
    tp_cp: Any = None

    @classmethod
    def from_parallel(cls, parallel: Any) -> MoEGroups:
        if parallel is None or parallel.grid is None:
            return cls()
        g = parallel.group
        return cls(g("ep"), g("etp"), g("etp-ep"), parallel.tp_group, g("tp-cp"))

    @property
    def ep_rank(self) -> int:
        return _rank(self.ep)

    @property
    def etp_rank(self) -> int:
        return _rank(self.etp)


def _check_inputs(hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, e: int):
    if hidden.dim() != 2 or probs.shape != (hidden.size(0), e) or routing_map.shape != probs.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, probs {tuple(probs.shape)}, routing_map "
            f"{tuple(routing_map.shape)}; the rule: hidden [T, h], probs and routing_map "
            f"[T, num_moe_experts={e}]; fix: flatten the tokens and pass the router's outputs"
        )


class AllGatherTokenDispatcher:
    """Gather every token of the etp-ep group, run the local experts on theirs."""

    def __init__(self, config: Any, num_local_experts: int, groups: MoEGroups) -> None:
        self.config, self.num_local_experts, self.groups = config, num_local_experts, groups

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        if _size(self.groups.etp_ep) == 1:
            return x
        return gather_from_sequence_parallel_region(x, self.groups.etp_ep, True)

    def _gather_map(self, routing_map: torch.Tensor) -> torch.Tensor:
        n = _size(self.groups.etp_ep)
        if n == 1:
            return routing_map
        out = routing_map.new_empty((n * routing_map.size(0), routing_map.size(1)))
        comm.all_gather_into_tensor(out, routing_map.contiguous(), group=self.groups.etp_ep)
        return out

    def dispatch(self, hidden, probs, routing_map):
        """`[T, h]` -> (`[N, h]` local-expert-major, tokens_per_expert, ctx)."""
        _check_inputs(hidden, probs, routing_map, self.config.num_moe_experts)
        n, local = _size(self.groups.etp_ep), self.num_local_experts
        first = self.groups.ep_rank * local
        all_hidden = self._gather(hidden)
        all_probs = self._gather(probs)[:, first : first + local]
        all_map = self._gather_map(routing_map)[:, first : first + local]
        cap = expert_capacity(hidden.size(0), self.config)
        pad = cap * n if cap is not None and self.config.moe_pad_expert_input_to_capacity else None
        x, indices = permute(all_hidden, all_map, pad)
        counts = [pad] * local if pad is not None else all_map.sum(0).tolist()
        return x, counts, (indices, all_probs, all_map, pad, all_hidden.size(0))

    def combine(self, y: torch.Tensor, ctx) -> torch.Tensor:
        """`[N, h]` -> `[T, h]`: weighted sum per token, reduce-scatter over etp-ep."""
        indices, all_probs, all_map, pad, rows = ctx
        wide = torch.promote_types(y.dtype, all_probs.dtype)  # the router dtype (Megatron)
        out = unpermute(y, indices, rows, all_probs, all_map, pad, out_dtype=wide)
        if _size(self.groups.etp_ep) > 1:
            out = reduce_scatter_to_sequence_parallel_region(out, self.groups.etp_ep)
        return out.to(y.dtype)


class _GatherUneven(torch.autograd.Function):
    """`[sizes[me], h]` -> all-gather(group) -> `[sum(sizes), h]`; backward: reduce-scatter.

    Ranks hold different row counts, so each pads to max(sizes) for the collective (gloo has
    no uneven all-gather): each rank moves max(sizes) rows, not sizes[me] (the ledger shows it).
    """

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _gather_uneven(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_uneven(grad, ctx.group, ctx.sizes), None, None


class _ReduceScatterUneven(torch.autograd.Function):
    """`[sum(sizes), h]` -> reduce-scatter(group) -> `[sizes[me], h]`; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group, sizes):
        ctx.group, ctx.sizes = group, sizes
        return _reduce_scatter_uneven(x, group, sizes)

    @staticmethod
    def backward(ctx, grad):
        return _gather_uneven(grad, ctx.group, ctx.sizes), None, None


def _padded(chunks: list[torch.Tensor], rows: int) -> torch.Tensor:
    return torch.cat(
        [torch.cat([c, c.new_zeros((rows - c.size(0), *c.shape[1:]))]) for c in chunks]
    )


def _gather_uneven(x: torch.Tensor, group: Any, sizes: list[int]) -> torch.Tensor:
    rows = max(sizes)
    out = x.new_empty((len(sizes) * rows, *x.shape[1:]))
    comm.all_gather_into_tensor(out, _padded([x.contiguous()], rows), group=group)
    parts = torch.split(out, rows)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


def _reduce_scatter_uneven(x: torch.Tensor, group: Any, sizes: list[int]) -> torch.Tensor:
    rows = max(sizes)
    out = x.new_empty((rows, *x.shape[1:]))
    comm.reduce_scatter_tensor(out, _padded(list(torch.split(x, sizes)), rows), group=group)
    return out[: sizes[_rank(group)]]


class AlltoAllTokenDispatcher:
    """Send each token copy to the ep rank of its expert (then share it over etp)."""

    def __init__(self, config: Any, num_local_experts: int, groups: MoEGroups) -> None:
        self.config, self.num_local_experts, self.groups = config, num_local_experts, groups
        self.ep_size, self.etp_size = _size(groups.ep), _size(groups.etp)

    def _exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Local per-expert counts `[E]` -> received counts `[etp, ep, E_local]`."""
        ep, etp, local = self.ep_size, self.etp_size, self.num_local_experts
        received = counts
        if ep > 1:
            received = torch.empty_like(counts)
            comm.all_to_all_single(received, counts, group=self.groups.ep)
        if etp > 1:
            gathered = received.new_empty((etp * received.numel(),))
            comm.all_gather_into_tensor(gathered, received, group=self.groups.etp)
            received = gathered
        return received.view(etp, ep, local)

    def dispatch(self, hidden, probs, routing_map):
        """`[T, h]` -> (`[N', h]` local-expert-major, tokens_per_expert, ctx)."""
        e = self.config.num_moe_experts
        _check_inputs(hidden, probs, routing_map, e)
        ep, etp, local = self.ep_size, self.etp_size, self.num_local_experts
        cap = expert_capacity(hidden.size(0), self.config)
        pad = cap if cap is not None and self.config.moe_pad_expert_input_to_capacity else None
        x, indices = permute(hidden, routing_map, pad)
        counts = (
            torch.full((e,), pad, dtype=torch.long, device=hidden.device)
            if pad is not None
            else routing_map.sum(0).to(torch.long)
        )
        received = self._exchange_counts(counts)  # [etp, ep, E_local]
        # The layer's one host read: every split size below derives from these counts.
        host = torch.cat([counts, received.flatten()]).tolist()
        sent_counts, chunk_sizes = host[:e], host[e:]  # chunks ordered (etp, ep, expert)
        send = [sum(sent_counts[r * local : (r + 1) * local]) for r in range(ep)]
        per_etp = [chunk_sizes[i * ep * local : (i + 1) * ep * local] for i in range(etp)]
        mine = per_etp[self.groups.etp_rank]
        recv = [sum(mine[r * local : (r + 1) * local]) for r in range(ep)]
        if ep > 1:
            x = all_to_all(x, self.groups.ep, recv, send)
        gather_sizes = [sum(part) for part in per_etp]
        if etp > 1:
            x = _GatherUneven.apply(x, self.groups.etp, gather_sizes)
        sources = etp * ep
        order = [r * local + j for j in range(local) for r in range(sources)]
        x = sort_chunks(x, chunk_sizes, order)
        tokens_per_expert = [
            sum(chunk_sizes[r * local + j] for r in range(sources)) for j in range(local)
        ]
        ctx = (indices, probs, routing_map, pad, hidden.size(0), send, recv, gather_sizes)
        return x, tokens_per_expert, (*ctx, [chunk_sizes[i] for i in order], order)

    def combine(self, y: torch.Tensor, ctx) -> torch.Tensor:
        """`[N', h]` -> `[T, h]` (the reverse of `dispatch`, then the weighted sum)."""
        indices, probs, routing_map, pad, rows, send, recv, gather_sizes, sizes, order = ctx
        back = [0] * len(order)
        for pos, i in enumerate(order):
            back[i] = pos
        y = sort_chunks(y, sizes, back)
        if self.etp_size > 1:  # summed in the router dtype, as Megatron
            wide = torch.promote_types(y.dtype, probs.dtype)
            y = _ReduceScatterUneven.apply(y.to(wide), self.groups.etp, gather_sizes).to(y.dtype)
        if self.ep_size > 1:
            y = all_to_all(y, self.groups.ep, send, recv)
        return unpermute(y, indices, rows, probs, routing_map, pad)


def build_dispatcher(config: Any, num_local_experts: int, groups: MoEGroups) -> Any:
    """The dispatcher named by `config.moe_token_dispatcher_type`."""
    if config.moe_token_dispatcher_type == "alltoall":
        return AlltoAllTokenDispatcher(config, num_local_experts, groups)
    return AllGatherTokenDispatcher(config, num_local_experts, groups)
