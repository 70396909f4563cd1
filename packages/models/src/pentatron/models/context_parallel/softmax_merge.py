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


# Load-balanced chunk pairs. A cp rank holds chunks (r, 2cp-1-r) as `[.., 2L, ..]`; against
# the K/V pair of cp rank src, causality leaves one of three block shapes:
# - "diag" (src == r): the causal diagonal on the concatenated 2L positions;
# - "lower" (src < r): every query sees only src's first chunk;
# - "upper" (src > r): only the second-half queries see src's chunks (all of them).
def pair_case(src: int, rank: int) -> str:
    """Which of "diag", "lower", "upper" the K/V pair of cp rank `src` is for `rank`."""
    return "diag" if src == rank else ("lower" if src < rank else "upper")


def pair_forward(case: str, q, k, v, scale: float, out=None, lse=None):
    """Fold the K/V pair k/v `[b, g, 2L, d]` into (out, lse) of q `[b, n, 2L, d]`.

    "diag" starts the result (out/lse None); the others merge into it.
    """
    half = q.size(2) // 2
    if case == "diag":
        return block_forward(q, k, v, scale, causal=True)
    if case == "lower":
        o, s = block_forward(q, k[:, :, :half], v[:, :, :half], scale, False)
        return merge(out, lse, o, s)
    o, s = block_forward(q[:, :, half:], k, v, scale, False)
    o2, s2 = merge(out[:, :, half:], lse[:, :, half:], o, s)
    return torch.cat([out[:, :, :half], o2], 2), torch.cat([lse[:, :, :half], s2], 2)


def pair_grads(case: str, q, k, v, lse, dout, delta, scale: float):
    """(dq part, dK|dV part `[2, b, g, ., d]`, q rows, kv rows) of one K/V pair."""
    half = q.size(2) // 2
    if case == "diag":
        dq, dk, dv = block_backward(q, k, v, lse, dout, delta, scale, True)
        return dq, torch.stack([dk, dv]), slice(None), slice(None)
    if case == "lower":
        kh, vh = k[:, :, :half], v[:, :, :half]
        dq, dk, dv = block_backward(q, kh, vh, lse, dout, delta, scale, False)
        return dq, torch.stack([dk, dv]), slice(None), slice(0, half)
    r = slice(half, None)
    dq, dk, dv = block_backward(
        q[:, :, r], k, v, lse[:, :, r], dout[:, :, r], delta[:, :, r], scale, False
    )
    return dq, torch.stack([dk, dv]), r, slice(None)
