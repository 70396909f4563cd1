"""Ring attention (cp_comm_type="p2p"): K/V blocks travel around the cp ring.

Each rank holds q, k, v of its two load-balanced chunks (r, 2cp-1-r), `[b, n|g, 2L, d]`.
Step i computes with the K/V of cp rank src = r - i (mod cp) while the next block is in
flight (batch_isend_irecv to r + 1, from r - 1), and merges with the online-softmax rule:
- step 0 (own K/V): the causal diagonal on the concatenated 2L positions;
- src < r: every query sees only src's first chunk (all queries x first half of KV);
- src > r: only the second-half queries see src's chunks (second half of q x all KV).
Forward: cp - 1 sends of one packed K/V block. Backward re-circulates K/V (cp - 1 sends)
and sends each block's dK/dV accumulator with it (cp - 1 sends), recomputing only the
per-block softmax from the saved LSE.
gpt-oss's variants (softmax_merge): a window masks each block by global positions (a
block no query sees is skipped, its K/V still passed on); the sinks fold in after the
last block, and their grad comes from the saved (final) lse.
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


class _Ring:
    """The neighbours of this rank in the cp group (global ranks)."""

    def __init__(self, group: Any) -> None:
        ranks = dist.get_process_group_ranks(group)
        self.size, self.group = len(ranks), group
        self.rank = ranks.index(dist.get_rank())
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[self.rank - 1]

    def exchange(self, send: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Start: send `send` to next, receive the same shape from prev."""
        recv = torch.empty_like(send)
        ops = [
            comm.P2POp("send", send, self.next, self.group),
            comm.P2POp("recv", recv, self.prev, self.group),
        ]
        return recv, comm.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _quadrants(src: int, q: torch.Tensor, ring: _Ring, window: int | None):
    return window_quadrants(src, ring.rank, ring.size, q.size(2) // 2, window, q.device)


def _ring_forward(q, k, v, scale: float, ring: _Ring, window=None, fused: bool = True):
    """-> out `[b, n, 2L, d]` fp32, lse `[b, n, 2L]`."""
    kv = torch.stack([k, v])
    out = lse = None
    for step in range(ring.size):
        works: list = []
        if step < ring.size - 1:
            nxt, works = ring.exchange(kv)
        src = (ring.rank - step) % ring.size
        quads = _quadrants(src, q, ring, window)
        case = pair_case(src, ring.rank)
        out, lse = pair_forward(case, q, kv[0], kv[1], scale, out, lse, quads, fused)
        _wait(works)
        if step < ring.size - 1:
            kv = nxt
    return out, lse


def _ring_backward(
    q, k, v, out, lse, dout, delta, scale: float, ring: _Ring, window=None, fused: bool = True
):
    """-> dq `[b, n, 2L, d]`, dk, dv `[b, g, 2L, d]` (fp32).

    K/V travel in their own dtype (as in forward) and enter the GEMMs in it; the dK/dV
    accumulators travel in fp32. Each step's K/V exchange overlaps that step's block, and
    the accumulator sent at step i is waited for only when step i + 1 adds to it, so it
    overlaps the next block's computation too.
    """
    kv = torch.stack([k, v])
    dq = torch.zeros_like(q, dtype=torch.float32)
    own = torch.zeros_like(kv, dtype=torch.float32)
    acc: torch.Tensor | None = None  # dK/dV of the block in hand, from the ranks before
    acc_works: list = []  # the accumulator's transfer in flight
    for step in range(ring.size):
        works: list = []
        if step < ring.size - 1:
            nxt, works = ring.exchange(kv)
        src = (ring.rank - step) % ring.size
        case = pair_case(src, ring.rank)
        quads = _quadrants(src, q, ring, window)
        grads = pair_grads(case, q, kv[0], kv[1], out, lse, dout, delta, scale, quads, fused)
        if grads is not None:  # None: a windowed block no query sees
            dq_p, dkv_p, qrows, kvrows = grads
            dq[:, :, qrows] += dq_p
        if step == 0:
            assert grads is not None, "every query sees its own key"
            own += dkv_p
        else:
            _wait(acc_works)
            acc = torch.zeros_like(own) if acc is None else acc
            if grads is not None:
                acc[:, :, :, kvrows] += dkv_p
            # to the next rank, which holds this block next (or, last step, owns it)
            acc, acc_works = ring.exchange(acc)
        _wait(works)
        if step < ring.size - 1:
            kv = nxt
    _wait(acc_works)
    if acc is not None:
        own += acc
    return dq, own[0], own[1]


class RingAttention(torch.autograd.Function):
    """q `[b, n, 2L, d]`, k/v `[b, g, 2L, d]` (this rank's chunks), sinks `[n]` or None,
    window (keys back) or None, fused (False: the blocks on the unfused maths) ->
    out `[b, n, 2L, d]`."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, scale: float, group: Any, window, fused: bool = True):
        ring = _Ring(group)
        out, lse = _ring_forward(q, k, v, scale, ring, window, fused)
        out, lse = add_sinks(out, lse, sinks)
        out = out.to(q.dtype)  # saved as returned, not the fp32 merge (see softmax_delta)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.scale, ctx.ring, ctx.window, ctx.fused = scale, ring, window, fused
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        delta = softmax_delta(dout, out)  # dout stays in its dtype for the GEMMs
        dq, dk, dv = _ring_backward(
            q, k, v, out, lse, dout, delta, ctx.scale, ctx.ring, ctx.window, ctx.fused
        )
        dsinks = None
        if ctx.needs_input_grad[3]:
            dsinks = sinks_grad(lse, delta, sinks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None, None


def ring_attention(
    q, k, v, scale: float, group: Any, sinks=None, window: int | None = None, fused: bool = True
) -> torch.Tensor:
    """Causal attention over the cp ring; shapes as `RingAttention`."""
    return RingAttention.apply(q, k, v, sinks, scale, group, window, fused)
