"""Blockwise attention math for context parallelism: one block's output and log-sum-exp,
the online-softmax merge of partial results, and a block's backward from the final LSE.

Layouts: q `[b, n, sq, d]`, k/v `[b, g, sk, d]` with n = g * heads_per_group (GQA: k/v are
repeated inside, their grads summed back); lse `[b, n, sq]`.

Precision, as flash attention's: the GEMMs take q, k, v, dout and the probabilities in the
compute dtype (bf16 / fp16 in a 16-bit model: tensor cores on a GPU, through bmm's fp32
result, `_mm`) and sum in fp32; scores, softmax, lse, the merge and the output accumulator
are fp32. Where the device has no such GEMM (the CPU) the operands are widened to fp32:
products of 16-bit values are exact in fp32, so both sum the same products. An fp32 model
computes in fp32 throughout. That is the unfused maths; a block without a window mask runs
a fused flash kernel instead where the device and dtype have one (`block_kernels`), and
the maths is then the reference it is tested against (`fused=False`).

gpt-oss's variants:
- a window of `left` keys back: a pair is four chunk-by-chunk quadrants (queries of chunk
  r or 2cp-1-r against keys of the other rank's two chunks); only those in which some
  query sees a key are computed, each masked by the global positions of its queries and
  keys (`window_quadrants`, decided from the chunk indices on the host: no device sync).
  A window shorter than a chunk leaves one or two of the four, where the causal kinds
  compute two; a pair with none is skipped (None). A query row
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

from .block_kernels import fold_heads, fused_backward, fused_forward, fused_kernel, repeat_heads

_LOW = (torch.bfloat16, torch.float16)
_OUT_DTYPE: dict[tuple[str, torch.dtype], bool] = {}


def _takes_out_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    """Does `bmm(..., out_dtype=float32)` run on `dtype` operands on `device`? (CUDA: yes,
    on tensor cores; the CPU: no.) Probed once per device type and dtype."""
    key = (device.type, dtype)
    if key not in _OUT_DTYPE:
        a = torch.zeros(1, 2, 2, dtype=dtype, device=device)
        try:
            _OUT_DTYPE[key] = torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            _OUT_DTYPE[key] = False
    return _OUT_DTYPE[key]


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a [..., m, k] @ b [..., k, n]` -> fp32 `[..., m, n]`, operands in their own dtype
    where the device has a GEMM with an fp32 result, else widened (the same products)."""
    if a.dtype in _LOW and a.dtype == b.dtype and _takes_out_dtype(a.device, a.dtype):
        lead = a.shape[:-2]
        out = torch.bmm(
            a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), out_dtype=torch.float32
        )
        return out.view(*lead, a.size(-2), b.size(-1))
    return torch.matmul(a.float(), b.float())


def _scores(q, k, scale: float, causal: bool, keep: torch.Tensor | None = None) -> torch.Tensor:
    """q k^T scale (fp32), masked causally (the corner bottom-right) and / or by `keep`
    `[sq, sk]`."""
    s = _mm(q, k.transpose(-1, -2)) * scale
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
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out `[b, n, sq, d]` fp32, lse `[b, n, sq]` fp32) of softmax(q k^T scale) v; a
    row `keep` leaves no key gets lse -inf and output 0. Without `keep`, a fused kernel
    where the device and dtype have one (`block_kernels`; `fused=False`: the maths)."""
    kernel = fused_kernel(q, k, v) if fused and keep is None else None
    if kernel is not None:
        return fused_forward(kernel, q, k, v, scale, causal)
    rep = q.size(1) // k.size(1)
    k, v = repeat_heads(k.to(q.dtype), rep), repeat_heads(v.to(q.dtype), rep)
    s = _scores(q, k, scale, causal, keep)
    lse = torch.logsumexp(s, dim=-1)
    finite = lse if keep is None else lse.masked_fill(torch.isinf(lse), 0.0)
    out = _mm(torch.exp(s - finite[..., None]).to(q.dtype), v)
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
    q,
    k,
    v,
    out,
    lse,
    dout,
    delta,
    scale: float,
    causal: bool,
    keep: torch.Tensor | None = None,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grads of one block from the FINAL out `[b, n, sq, d]`, lse and
    `delta = sum(dout * out, -1)` `[b, n, sq]` (this block's query rows).

    p = exp(s - lse) is the block's share of the full softmax, so
    dv = p^T dout, ds = p (dout v^T - delta), dq = ds k scale, dk = ds^T q scale.
    The GEMMs take p, ds and dout in q's dtype (see the module docstring). A fused kernel
    as in `block_forward` (it forms delta from out itself).
    -> (dq `[b, n, sq, d]`, dk, dv `[b, g, sk, d]`), fp32.
    """
    kernel = fused_kernel(q, k, v) if fused and keep is None else None
    if kernel is not None:
        return fused_backward(kernel, q, k, v, out, lse, dout, scale, causal)
    rep, low = q.size(1) // k.size(1), q.dtype
    kr, vr, dout = repeat_heads(k.to(low), rep), repeat_heads(v.to(low), rep), dout.to(low)
    p = torch.exp(_scores(q, kr, scale, causal, keep) - lse[..., None])
    dv = _mm(p.transpose(-1, -2).to(low), dout)
    ds = p * (_mm(dout, vr.transpose(-1, -2)) - delta[..., None])
    dq = _mm(ds.to(low), kr) * scale
    dk = _mm(ds.transpose(-1, -2).to(low), q) * scale
    return dq, fold_heads(dk, rep), fold_heads(dv, rep)


# Load-balanced chunk pairs. A cp rank holds chunks (r, 2cp-1-r) as `[.., 2L, ..]`; against
# the K/V pair of cp rank src, causality leaves one of three block shapes:
# - "diag" (src == r): the causal diagonal on the concatenated 2L positions;
# - "lower" (src < r): every query sees only src's first chunk;
# - "upper" (src > r): only the second-half queries see src's chunks (all of them).
def pair_case(src: int, rank: int) -> str:
    """Which of "diag", "lower", "upper" the K/V pair of cp rank `src` is for `rank`."""
    return "diag" if src == rank else ("lower" if src < rank else "upper")


Quadrant = tuple[slice, slice, torch.Tensor]


def window_quadrants(
    src: int, rank: int, cp: int, half: int, window: int | None, device: Any
) -> list[Quadrant] | None:
    """The quadrants of the pair (queries of cp rank `rank`, keys of cp rank `src`) in which
    some query sees a key under a causal window of `window` keys back: (query rows, key
    rows of the pair's `2L`, `[L, L]` bool keep on `device`). None without a window."""
    if window is None:
        return None
    parts = []
    for qi, cq in enumerate((rank, 2 * cp - 1 - rank)):
        for ki, ck in enumerate((src, 2 * cp - 1 - src)):
            q0, k0 = cq * half, ck * half
            if ck > cq or k0 + half - 1 < q0 - window:  # all future, or all out of reach
                continue
            qp = torch.arange(q0, q0 + half, device=device)[:, None]
            kp = torch.arange(k0, k0 + half, device=device)[None, :]
            keep = (kp <= qp) & (kp >= qp - window)
            parts.append(
                (slice(qi * half, (qi + 1) * half), slice(ki * half, (ki + 1) * half), keep)
            )
    return parts


def pair_forward(
    case: str, q, k, v, scale: float, out=None, lse=None, quadrants=None, fused: bool = True
):
    """Fold the K/V pair k/v `[b, g, 2L, d]` into (out, lse) of q `[b, n, 2L, d]`.

    "diag" starts the result (out/lse None); the others merge into it. With a window's
    `quadrants` (`window_quadrants`) only those are scored; none: the pair is skipped.
    `fused=False`: the unfused maths for every block.
    """
    half = q.size(2) // 2
    if quadrants is not None:
        parts = quadrants
        if not parts:
            return out, lse
        if out is None:  # the diagonal pair: every row gets its own key below
            out = q.new_zeros(q.shape, dtype=torch.float32)
            lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
        else:  # the rows are merged in place: not into the caller's tensors
            out, lse = out.clone(), lse.clone()
        for qs, ks, sub in parts:
            o, s = block_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], scale, False, sub)
            out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], o, s)
        return out, lse
    if case == "diag":
        return block_forward(q, k, v, scale, True, fused=fused)
    if case == "lower":
        o, s = block_forward(q, k[:, :, :half], v[:, :, :half], scale, False, fused=fused)
        return merge(out, lse, o, s)
    o, s = block_forward(q[:, :, half:], k, v, scale, False, fused=fused)
    o2, s2 = merge(out[:, :, half:], lse[:, :, half:], o, s)
    return torch.cat([out[:, :, :half], o2], 2), torch.cat([lse[:, :, :half], s2], 2)


def pair_grads(
    case: str, q, k, v, out, lse, dout, delta, scale: float, quadrants=None, fused: bool = True
):
    """(dq part, dK|dV part `[2, b, g, ., d]`, q rows, kv rows) of one K/V pair, from the
    final out and lse; None for a windowed pair that sees nothing."""
    half = q.size(2) // 2
    if quadrants is not None:
        parts = quadrants
        if not parts:
            return None
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        for qs, ks, sub in parts:
            dq_p, dk_p, dv_p = block_backward(
                q[:, :, qs],
                k[:, :, ks],
                v[:, :, ks],
                out[:, :, qs],
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
        dq, dk, dv = block_backward(q, k, v, out, lse, dout, delta, scale, True, fused=fused)
        return dq, torch.stack([dk, dv]), slice(None), slice(None)
    if case == "lower":
        kh, vh = k[:, :, :half], v[:, :, :half]
        dq, dk, dv = block_backward(q, kh, vh, out, lse, dout, delta, scale, False, fused=fused)
        return dq, torch.stack([dk, dv]), slice(None), slice(0, half)
    r = slice(half, None)
    dq, dk, dv = block_backward(
        q[:, :, r],
        k,
        v,
        out[:, :, r],
        lse[:, :, r],
        dout[:, :, r],
        delta[:, :, r],
        scale,
        False,
        fused=fused,
    )
    return dq, torch.stack([dk, dv]), r, slice(None)


def softmax_delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`sum(dout * out, -1)` in fp32 `[b, n, sq]`, from the output as the cp function returned
    and saved it (the model's dtype). The fused kernels form it from that output too (they
    take out in q's dtype); keeping the fp32 merge instead would cost 4 bytes an element
    of the layer's output, per layer, until backward."""
    return (dout.float() * out.float()).sum(-1)


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
