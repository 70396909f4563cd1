"""All-gather attention (cp_comm_type="all_gather"): every rank gathers the whole K/V.

    k, v [s/cp, b, g, d] -> cat along d -> all-gather(cp) -> [s, b, g, 2d] (rank-major shards)
    backward: reduce-scatter(cp) of the K/V grads
The causal mask is built from the global positions of the load-balanced chunks, so the
gathered K/V need no reordering.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pentatron.parallel_state import comm

from .sharding import cp_positions


class _GatherSeq(torch.autograd.Function):
    """`[s/cp, ...]` -> all-gather(cp) -> `[s, ...]` (rank-major); backward reduce-scatter."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, n = group, dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((n * x.size(0), *x.shape[1:]))
        comm.all_gather_into_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        out = grad.new_empty((grad.size(0) // n, *grad.shape[1:]))
        comm.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


def gather_positions(local_len: int, cp_size: int) -> torch.Tensor:
    """Global positions `[s]` of the rank-major gathered sequence."""
    s = local_len * cp_size
    return torch.cat([cp_positions(s, cp_size, r) for r in range(cp_size)])


def all_gather_attention(q, k, v, scale: float, group: Any, cp_rank: int) -> torch.Tensor:
    """q `[s/cp, b, n, d]`, k/v `[s/cp, b, g, d]` -> out `[b, n, s/cp, d]` (causal)."""
    cp, d = dist.get_world_size(group), k.size(-1)
    kv = _GatherSeq.apply(torch.cat([k, v], dim=-1), group)  # [s, b, g, 2d]
    k_all, v_all = kv[..., :d], kv[..., d:]
    s_local = q.size(0)
    q_pos = cp_positions(s_local * cp, cp, cp_rank, device=q.device)
    k_pos = gather_positions(s_local, cp).to(q.device)
    allowed = k_pos[None, :] <= q_pos[:, None]  # [s/cp, s]
    q, k_all, v_all = (x.permute(1, 2, 0, 3) for x in (q, k_all, v_all))
    # enable_gqa reads each group's K/V for its heads: no [b, n, s, d] repeated copies saved
    return F.scaled_dot_product_attention(
        q, k_all, v_all, attn_mask=allowed, scale=scale, enable_gqa=q.size(1) != k_all.size(1)
    )
