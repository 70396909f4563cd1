"""Causal/masked SDPA over grouped-query heads: k/v repeated only where a kernel needs it.

    q [b, n, s, d], k/v [b, g, s, d] (n = g * heads_per_group) -> [b, n, s, d]

SDPA's flash kernels (CUDA and CPU) read grouped k/v themselves (`enable_gqa`), so the nq
repeated heads are neither built nor kept for backward. With an attention mask, or heads
over 256 dims, the kernel that would run may not take GQA and SDPA would fall back to its
math kernel, so k/v are repeated to n heads first (as Hugging Face's SDPA path decides).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_GQA_HEAD_DIM = 256


def takes_grouped_kv(heads_per_group: int, has_mask: bool, head_dim: int) -> bool:
    """Whether `grouped_sdpa` hands SDPA the g grouped k/v heads as they are."""
    return heads_per_group > 1 and not has_mask and head_dim <= MAX_GQA_HEAD_DIM


def grouped_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` for n query heads over g = n / rep k/v heads."""
    rep = q.size(1) // k.size(1)
    gqa = takes_grouped_kv(rep, attn_mask is not None, q.size(-1))
    if rep > 1 and not gqa:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=gqa,
    )
