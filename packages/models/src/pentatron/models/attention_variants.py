"""Sliding-window attention and softmax sinks (gpt-oss), on torch SDPA's kernels.

Megatron's semantics (its local DotProductAttention, `FusedScaleMaskSoftmax` and
`SoftmaxOne`):
- window `(left, 0)`: query i attends to keys i - left .. i (gpt-oss: left 127, 128 keys);
  `TransformerConfig.is_window_attention_layer` says which layers (window_attn_skip_freq);
- softmax sink, one logit a_h per query head h: `p_ij = exp(l_ij) / (exp(a_h) + sum_k
  exp(l_ik))`; the sink takes probability but adds no value. "off-by-one" fixes a_h = 0,
  "learnable" makes it a parameter (tp-split by heads, initialised by the init method).

SDPA has no sink argument, so `sink_sdpa` adds one key that every query sees: head dims
are padded by 8 (the fused kernels want multiples of 8), q carries a_h / scale in its
first pad column, the sink key is 1 there and 0 elsewhere, its value is 0. Then
`scale * q' . k_sink = a_h` for every query of head h and the other logits are unchanged,
so SDPA's softmax is exactly the sink softmax, its output the sink attention's, and
autograd gives a_h's gradient through q's pad column. The cost: 8 more head dims in the
attention GEMMs (1/8 at gpt-oss's d = 64), copies of q, k and v kept for backward, and an
explicit mask (SDPA's `is_causal` aligns the corner top-left, which would hide the last
real key); a mask takes SDPA's memory-efficient kernel on CUDA, not flash.

A window of `left` keys back runs blockwise when the sequence is long against it
(`blockwise_window`): queries in blocks of `left + 1`, each block with only the keys its
queries can see (the block's and the `left` before it), one SDPA call over all blocks as a
batch. Attention then costs `s (2 left + 1)` scores instead of `s^2`, and the mask is
`[blocks, left + 1, 2 left + 1]`, not `[s, s]` (gpt-oss at 8192 tokens: 1/32 of both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .sdpa import grouped_sdpa

# blockwise from this many query blocks of left + 1 on: below, the full masked call is as cheap
MIN_WINDOW_BLOCKS = 3

SINK_PAD = 8  # head-dim padding that carries the sink column (keeps d a multiple of 8)


def window_keep_mask(s: int, left: int, device: torch.device) -> torch.Tensor:
    """`[s, s]` bool, True where query i may see key j: i - left <= j <= i."""
    i = torch.arange(s, device=device).view(s, 1)
    j = torch.arange(s, device=device).view(1, s)
    return (j <= i) & (j >= i - left)


def sink_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    *,
    keep: torch.Tensor | None,
    dropout_p: float,
    scale: float,
    attention_backend: str,
) -> torch.Tensor:
    """Attention with one sink logit per query head.

    q `[b, n, s, d]`, k/v `[b, g, s, d]`, sinks `[n]` (this rank's heads), keep: bool
    broadcastable to `[b, n, s, s]`, True = may attend (None: causal) -> `[b, n, s, d]`.
    """
    b, n, s, d = q.shape
    g = k.size(1)
    if keep is None:
        keep = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    wide = torch.promote_types(sinks.dtype, torch.float32)  # a_h / scale before q's rounding
    column = (sinks.to(wide) / scale).to(q.dtype).view(1, n, 1, 1).expand(b, n, s, 1)
    q2 = torch.cat([q, column, q.new_zeros(b, n, s, SINK_PAD - 1)], dim=-1)
    sink_key = k.new_zeros(b, g, 1, d + SINK_PAD)
    sink_key[..., d] = 1.0
    k2 = torch.cat([sink_key, torch.nn.functional.pad(k, (0, SINK_PAD))], dim=2)
    v2 = torch.nn.functional.pad(v, (0, SINK_PAD, 1, 0))  # a zero value for the sink key
    sees_sink = torch.ones(*keep.shape[:-1], 1, dtype=torch.bool, device=keep.device)
    keep2 = torch.cat([sees_sink, keep], dim=-1)  # [.., s, s + 1]
    out = grouped_sdpa(
        q2,
        k2,
        v2,
        attn_mask=keep2,
        dropout_p=dropout_p,
        scale=scale,
        attention_backend=attention_backend,
    )
    return out[..., :d]


def blockwise_window(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    left: int,
    *,
    sinks: torch.Tensor | None,
    dropout_p: float,
    scale: float,
    attention_backend: str,
) -> torch.Tensor:
    """Causal attention of a window of `left` keys back, query block by query block.

    q `[b, n, s, d]`, k/v `[b, g, s, d]`, sinks `[n]` or None -> `[b, n, s, d]`. Block j
    holds queries `j B .. j B + B - 1` (B = left + 1, the end padded) and keys
    `j B - left .. j B + B - 1` (the start padded); the padded keys are masked out.
    """
    b, n, s, d = q.shape
    g, blk = k.size(1), left + 1
    nb = -(-s // blk)
    tail = nb * blk - s
    width = left + blk  # keys a block sees

    def key_blocks(x: torch.Tensor) -> torch.Tensor:  # [b, g, s, d] -> [b nb, g, width, d]
        padded = F.pad(x, (0, 0, left, tail))  # [b, g, left + nb blk, d]
        windows = padded.unfold(2, width, blk)  # [b, g, nb, d, width]
        return windows.permute(0, 2, 1, 4, 3).reshape(b * nb, g, width, d)

    qb = F.pad(q, (0, 0, 0, tail)).view(b, n, nb, blk, d).transpose(1, 2).reshape(b * nb, n, blk, d)
    kb, vb = key_blocks(k), key_blocks(v)
    t = torch.arange(blk, device=q.device).view(blk, 1)
    u = torch.arange(width, device=q.device).view(1, width)
    band = (u >= t) & (u <= t + left)  # query t of a block sees its keys t .. t + left
    first_key = torch.arange(nb, device=q.device).view(nb, 1) * blk - left
    real = (first_key + u) >= 0  # [nb, width]: not the start padding
    keep = (band.view(1, blk, width) & real.view(nb, 1, width)).view(1, nb, 1, blk, width)
    keep = keep.expand(b, nb, 1, blk, width).reshape(b * nb, 1, blk, width)
    if sinks is not None:
        out = sink_sdpa(
            qb,
            kb,
            vb,
            sinks,
            keep=keep,
            dropout_p=dropout_p,
            scale=scale,
            attention_backend=attention_backend,
        )
    else:
        out = grouped_sdpa(
            qb,
            kb,
            vb,
            attn_mask=keep,
            dropout_p=dropout_p,
            scale=scale,
            attention_backend=attention_backend,
        )
    return out.view(b, nb, n, blk, d).transpose(1, 2).reshape(b, n, nb * blk, d)[:, :, :s]


def variant_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    sinks: torch.Tensor | None,
    window: int | None,
    keep: torch.Tensor | None,
    dropout_p: float,
    scale: float,
    attention_backend: str,
) -> torch.Tensor:
    """Causal attention with gpt-oss's variants: q `[b, n, s, d]`, k/v `[b, g, s, d]`,
    `sinks` `[n]` or None, `window` keys back or None, `keep` a custom bool mask (True =
    may attend) or None -> `[b, n, s, d]`. Blockwise for a window over a long sequence."""
    s = q.size(2)
    if window is not None and keep is None and -(-s // (window + 1)) >= MIN_WINDOW_BLOCKS:
        return blockwise_window(
            q,
            k,
            v,
            window,
            sinks=sinks,
            dropout_p=dropout_p,
            scale=scale,
            attention_backend=attention_backend,
        )
    if window is not None:
        band = window_keep_mask(s, window, q.device)
        keep = band if keep is None else keep & band
    if sinks is not None:
        return sink_sdpa(
            q,
            k,
            v,
            sinks,
            keep=keep,
            dropout_p=dropout_p,
            scale=scale,
            attention_backend=attention_backend,
        )
    return grouped_sdpa(
        q,
        k,
        v,
        attn_mask=keep,
        dropout_p=dropout_p,
        is_causal=keep is None,
        scale=scale,
        attention_backend=attention_backend,
    )
