"""Blockwise attention math for context parallelism: one block's output and log-sum-exp,
the online-softmax merge of partial results, and a block's backward from the final LSE.

Layouts: q `[b, n, sq, d]`, k/v `[b, g, sk, d]` with n = g * heads_per_group (GQA: k/v are
repeated inside, their grads summed back); lse `[b, n, sq]`. Math is fp32.
"""

from __future__ import annotations

import torch


def _repeat(x: torch.Tensor, rep: int) -> torch.Tensor:
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _fold(dx: torch.Tensor, rep: int) -> torch.Tensor:
    """`[b, g*rep, s, d]` -> `[b, g, s, d]`: sum the grads of the repeated heads."""
    if rep == 1:
        return dx
    b, n, s, d = dx.shape
    return dx.view(b, n // rep, rep, s, d).sum(2)


def _scores(q, k, scale: float, causal: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        sq, sk = s.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(sk - sq)
        s = s.masked_fill(~mask, float("-inf"))
    return s


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out `[b, n, sq, d]` fp32, lse `[b, n, sq]` fp32) of softmax(q k^T scale) v."""
    rep = q.size(1) // k.size(1)
    q, k, v = q.float(), _repeat(k.float(), rep), _repeat(v.float(), rep)
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse[..., None]), v)
    return out, lse


def merge(
    out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: combine two partial results over disjoint key sets."""
    new = torch.logaddexp(lse, lse_b)
    out = out * torch.exp(lse - new)[..., None] + out_b * torch.exp(lse_b - new)[..., None]
    return out, new


def block_backward(
    q, k, v, lse, dout, delta, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grads of one block from the FINAL lse and `delta = sum(dout * out, -1)` `[b, n, sq]`.

    p = exp(s - lse) is the block's share of the full softmax, so
    dv = p^T dout, ds = p (dout v^T - delta), dq = ds k scale, dk = ds^T q scale.
    -> (dq `[b, n, sq, d]`, dk, dv `[b, g, sk, d]`), fp32.
    """
    rep = q.size(1) // k.size(1)
    q, kr, vr = q.float(), _repeat(k.float(), rep), _repeat(v.float(), rep)
    p = torch.exp(_scores(q, kr, scale, causal) - lse[..., None])
    dv = torch.matmul(p.transpose(-1, -2), dout)
    ds = p * (torch.matmul(dout, vr.transpose(-1, -2)) - delta[..., None])
    dq = torch.matmul(ds, kr) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    return dq, _fold(dk, rep), _fold(dv, rep)
