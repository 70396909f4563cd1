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
explicit `[s, s + 1]` mask (SDPA's `is_causal` aligns the corner top-left, which would hide
the last real key); a mask takes SDPA's memory-efficient kernel on CUDA, not flash.
"""

from __future__ import annotations

import torch

from .sdpa import grouped_sdpa

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
