"""All-gather attention (cp_comm_type="all_gather"): every rank gathers the whole K/V.

    k, v [s/cp, b, g, d] -> cat along d -> all-gather(cp) -> [s, b, g, 2d] (rank-major)
    forward: this rank's queries attend to each cp rank's K/V pair in turn (diag, lower or
             upper block of the load-balanced layout, see softmax_merge.pair_case), merged
             by online softmax; no [s/cp, s] mask is built.
    saved:   q, the LOCAL k and v, out (fp32) and lse: all `[s/cp, ...]`, so the saved
             activations fall by cp like the ring's.
    backward: all-gather(cp) of K|V again, dq and the full dK|dV [s, b, g, 2d] from the
             saved lse, then reduce-scatter(cp) of dK|dV.
The extra all-gather in backward buys the 1/cp memory: keeping the gathered K/V would save
a full-sequence tensor per layer. Megatron / Transformer Engine make the same trade when
they do not keep the gathered KV.
gpt-oss's variants as in the ring (softmax_merge): windowed pairs masked by global
positions (pairs no query sees are skipped), sinks folded in after the last pair.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pentatron.parallel_state import comm

from .softmax_merge import (
    add_sinks,
    pair_case,
    pair_forward,
    pair_grads,
    sinks_grad,
    softmax_delta,
    window_quadrants,
)


def _gather_kv(k: torch.Tensor, v: torch.Tensor, group: Any) -> torch.Tensor:
    """k, v `[s/cp, b, g, d]` -> all-gather(cp) -> `[cp, 2, b, g, s/cp, d]` (per rank's pair)."""
    n = dist.get_world_size(group)
    kv = torch.cat([k, v], dim=-1).contiguous()  # one packed collective for K and V
    out = kv.new_empty((n * kv.size(0), *kv.shape[1:]))
    comm.all_gather_into_tensor(out, kv, group=group)
    s_local, d = k.size(0), k.size(-1)
    # [cp, s/cp, b, g, 2, d] -> [cp, 2, b, g, s/cp, d]
    return out.view(n, s_local, *k.shape[1:3], 2, d).permute(0, 4, 2, 3, 1, 5)


def _reduce_scatter_kv(dkv: torch.Tensor, dtype: torch.dtype, group: Any):
    """dK|dV `[cp, 2, b, g, s/cp, d]` -> reduce-scatter(cp) -> dk, dv `[s/cp, b, g, d]`."""
    n, _, b, g, s_local, d = dkv.shape
    packed = dkv.permute(0, 4, 2, 3, 1, 5).reshape(n * s_local, b, g, 2 * d)
    packed = packed.to(dtype).contiguous()  # the wire carries the grads in the input dtype
    out = packed.new_empty((s_local, b, g, 2 * d))
    comm.reduce_scatter_tensor(out, packed, group=group)
    return out[..., :d], out[..., d:]


def _order(rank: int, n: int) -> list[int]:
    """Own pair first: the causal diagonal starts the online-softmax result."""
    return [rank, *(j for j in range(n) if j != rank)]


class AllGatherAttention(torch.autograd.Function):
    """q `[s/cp, b, n, d]`, k/v `[s/cp, b, g, d]`, sinks `[n]` or None, window (keys back)
    or None, fused (False: the blocks on the unfused maths) -> out `[b, n, s/cp, d]` (causal)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, scale: float, group: Any, cp_rank: int, window, fused=True):
        kv = _gather_kv(k, v, group)
        qb = q.permute(1, 2, 0, 3)
        out = lse = None
        for j in _order(cp_rank, kv.size(0)):
            quads = window_quadrants(j, cp_rank, kv.size(0), q.size(0) // 2, window, q.device)
            case = pair_case(j, cp_rank)
            out, lse = pair_forward(case, qb, kv[j, 0], kv[j, 1], scale, out, lse, quads, fused)
        assert out is not None and lse is not None, "_order yields the own rank's pair first"
        out, lse = add_sinks(out, lse, sinks)
        out = out.to(q.dtype)  # saved as returned: the fp32 merge is not kept
        ctx.save_for_backward(q, k, v, out, lse, sinks)  # all [s/cp]: not the gathered kv
        ctx.scale, ctx.group, ctx.cp_rank, ctx.window = scale, group, cp_rank, window
        ctx.fused = fused
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        kv = _gather_kv(k, v, ctx.group)  # recompute the gather, not saved
        qb = q.permute(1, 2, 0, 3)
        delta = softmax_delta(dout, out)  # dout stays in its dtype for the GEMMs
        dq = torch.zeros_like(qb, dtype=torch.float32)
        dkv = torch.zeros_like(kv, dtype=torch.float32)
        for j in range(kv.size(0)):
            quads = window_quadrants(
                j, ctx.cp_rank, kv.size(0), q.size(0) // 2, ctx.window, q.device
            )
            case = pair_case(j, ctx.cp_rank)
            grads = pair_grads(
                case, qb, kv[j, 0], kv[j, 1], out, lse, dout, delta, ctx.scale, quads, ctx.fused
            )
            if grads is None:  # a windowed pair no query sees
                continue
            dq_p, dkv_p, qrows, kvrows = grads
            dq[:, :, qrows] += dq_p
            dkv[j, :, :, :, kvrows] += dkv_p
        dk, dv = _reduce_scatter_kv(dkv, k.dtype, ctx.group)
        dsinks = sinks_grad(lse, delta, sinks) if ctx.needs_input_grad[3] else None
        return dq.permute(2, 0, 1, 3).to(q.dtype), dk, dv, dsinks, None, None, None, None, None


def all_gather_attention(
    q,
    k,
    v,
    scale: float,
    group: Any,
    cp_rank: int,
    sinks=None,
    window: int | None = None,
    fused: bool = True,
) -> torch.Tensor:
    """q `[s/cp, b, n, d]`, k/v `[s/cp, b, g, d]` -> out `[b, n, s/cp, d]` (causal)."""
    return AllGatherAttention.apply(q, k, v, sinks, scale, group, cp_rank, window, fused)
