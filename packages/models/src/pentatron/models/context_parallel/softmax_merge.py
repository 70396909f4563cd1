"""Blockwise attention math for context parallelism: one block's output and log-sum-exp,
the online-softmax merge of partial results, and a block's backward from the final LSE.

Layouts: q `[b, n, sq, d]`, k/v `[b, g, sk, d]` with n = g * heads_per_group (GQA: k/v are
repeated inside, their grads summed back); lse `[b, n, sq]`. Math is fp32.

gpt-oss's variants:
- a window of `left` keys back masks each pair by the global positions of its queries and
  keys (`pair_keep`). A pair is four chunk-by-chunk quadrants (queries of chunk r or
  2cp-1-r against keys of the other rank's two chunks); only those in which some query
  sees a key are computed (a window shorter than a chunk leaves one or two of the four,
  where the causal kinds compute two), a pair with none is skipped (None). A query row
  that sees none of a block's keys gets lse -inf and output 0 there, which the merge
  ignores (every query sees its own key in the diagonal pair, so the result is finite);
- a softmax sink a_h per head is one more key with logit a_h and value 0, folded in after
  all blocks (`add_sinks`): lse' = logaddexp(lse, a_h), out' = out exp(lse - lse'). The
  blocks' backward is unchanged given lse' and out' (the sink's column has no value), and
  d a_h = -sum over queries of exp(a_h - lse') (dout . out') (`sinks_grad`).
"""

from __future__ import annotations

from typing import Any

import torch


def _repeat(x: torch.Tensor, rep: int) -> torch.Tensor:
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _fold(dx: torch.Tensor, rep: int) -> torch.Tensor:
    """`[b, g*rep, s, d]` -> `[b, g, s, d]`: sum the grads of the repeated heads."""
    if rep == 1:
        return dx
    b, n, s, d = dx.shape
    return dx.view(b, n // rep, rep, s, d).sum(2)


def _scores(q, k, scale: float, causal: bool, keep: torch.Tensor | None = None) -> torch.Tensor:
    """q k^T scale, masked causally (the corner bottom-right) and / or by `keep` `[sq, sk]`."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        sq, sk = s.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(sk - sq)
        s = s.masked_fill(~mask, float("-inf"))
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return s


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out `[b, n, sq, d]` fp32, lse `[b, n, sq]` fp32) of softmax(q k^T scale) v; a
    row `keep` leaves no key gets lse -inf and output 0."""
    rep = q.size(1) // k.size(1)
    q, k, v = q.float(), _repeat(k.float(), rep), _repeat(v.float(), rep)
    s = _scores(q, k, scale, causal, keep)
    lse = torch.logsumexp(s, dim=-1)
    finite = lse if keep is None else lse.masked_fill(torch.isinf(lse), 0.0)
    out = torch.matmul(torch.exp(s - finite[..., None]), v)
    return out, lse


def merge(
    out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: combine two partial results over disjoint key sets (a row neither
    saw stays lse -inf, output 0)."""
    new = torch.logaddexp(lse, lse_b)
    ref = new.masked_fill(torch.isinf(new), 0.0)  # both -inf: both weights exp(-inf) = 0
    out = out * torch.exp(lse - ref)[..., None] + out_b * torch.exp(lse_b - ref)[..., None]
    return out, new


def block_backward(
    q, k, v, lse, dout, delta, scale: float, causal: bool, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grads of one block from the FINAL lse and `delta = sum(dout * out, -1)` `[b, n, sq]`.

    p = exp(s - lse) is the block's share of the full softmax, so
    dv = p^T dout, ds = p (dout v^T - delta), dq = ds k scale, dk = ds^T q scale.
    -> (dq `[b, n, sq, d]`, dk, dv `[b, g, sk, d]`), fp32.
    """
    rep = q.size(1) // k.size(1)
    q, kr, vr = q.float(), _repeat(k.float(), rep), _repeat(v.float(), rep)
    p = torch.exp(_scores(q, kr, scale, causal, keep) - lse[..., None])
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


def pair_keep(src: int, rank: int, cp: int, half: int, window: int | None, device: Any):
    """`[2L, 2L]` bool: which of cp rank `src`'s keys each query of `rank` sees under a
    causal window of `window` keys back (None: no window -> None)."""
    if window is None:
        return None

    def positions(r: int) -> torch.Tensor:  # chunks r and 2cp-1-r of L tokens each
        a, b = r * half, (2 * cp - 1 - r) * half
        return torch.cat([torch.arange(a, a + half), torch.arange(b, b + half)]).to(device)

    qp, kp = positions(rank)[:, None], positions(src)[None, :]
    return (kp <= qp) & (kp >= qp - window)


def _quadrants(keep: torch.Tensor) -> list[tuple[slice, slice, torch.Tensor]]:
    """(query rows, key columns, their `keep`) of the chunk-by-chunk quadrants of a pair's
    `[2L, 2L]` mask in which some query sees a key."""
    half = keep.size(0) // 2
    parts = []
    for qs in (slice(0, half), slice(half, 2 * half)):
        for ks in (slice(0, half), slice(half, 2 * half)):
            sub = keep[qs, ks]
            if bool(sub.any()):
                parts.append((qs, ks, sub))
    return parts


def pair_forward(case: str, q, k, v, scale: float, out=None, lse=None, keep=None):
    """Fold the K/V pair k/v `[b, g, 2L, d]` into (out, lse) of q `[b, n, 2L, d]`.

    "diag" starts the result (out/lse None); the others merge into it. With a window's
    `keep` (`pair_keep`) the whole pair is one masked block, skipped when it sees nothing.
    """
    half = q.size(2) // 2
    if keep is not None:
        parts = _quadrants(keep)
        if not parts:
            return out, lse
        if out is None:  # the diagonal pair: every row gets its own key below
            out = q.new_zeros(q.shape, dtype=torch.float32)
            lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
        out, lse = out.clone(), lse.clone()
        for qs, ks, sub in parts:
            o, s = block_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], scale, False, sub)
            out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], o, s)
        return out, lse
    if case == "diag":
        return block_forward(q, k, v, scale, causal=True)
    if case == "lower":
        o, s = block_forward(q, k[:, :, :half], v[:, :, :half], scale, False)
        return merge(out, lse, o, s)
    o, s = block_forward(q[:, :, half:], k, v, scale, False)
    o2, s2 = merge(out[:, :, half:], lse[:, :, half:], o, s)
    return torch.cat([out[:, :, :half], o2], 2), torch.cat([lse[:, :, :half], s2], 2)


def pair_grads(case: str, q, k, v, lse, dout, delta, scale: float, keep=None):
    """(dq part, dK|dV part `[2, b, g, ., d]`, q rows, kv rows) of one K/V pair; None for
    a windowed pair that sees nothing."""
    half = q.size(2) // 2
    if keep is not None:
        parts = _quadrants(keep)
        if not parts:
            return None
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        for qs, ks, sub in parts:
            dq_p, dk_p, dv_p = block_backward(
                q[:, :, qs],
                k[:, :, ks],
                v[:, :, ks],
                lse[:, :, qs],
                dout[:, :, qs],
                delta[:, :, qs],
                scale,
                False,
                sub,
            )
            dq[:, :, qs] += dq_p
            dkv[0, :, :, ks] += dk_p
            dkv[1, :, :, ks] += dv_p
        return dq, dkv, slice(None), slice(None)
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


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None):
    """Fold one sink logit per head, `sinks` `[n]`, into the merged (out `[b, n, sq, d]`,
    lse `[b, n, sq]`) (fp32): a key every query sees, with value 0. None: unchanged."""
    if sinks is None:
        return out, lse
    new = torch.logaddexp(lse, sinks.float().view(1, -1, 1).expand_as(lse))
    return out * torch.exp(lse - new)[..., None], new


def sinks_grad(lse: torch.Tensor, delta: torch.Tensor, sinks: torch.Tensor | None):
    """d loss / d sinks `[n]` from the final lse and `delta = sum(dout * out, -1)`."""
    if sinks is None:
        return None
    p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)  # the sink's probability
    return (-(p_sink * delta).sum(dim=(0, 2))).to(sinks.dtype)
