"""Causal/masked SDPA over grouped-query heads: k/v repeated only where a kernel needs it.

    q [b, n, s, d], k/v [b, g, s, d] (n = g * heads_per_group) -> [b, n, s, d]

SDPA's flash kernels read grouped k/v themselves (`enable_gqa`), so the n repeated heads
are neither built nor kept for backward. k/v are repeated to n heads first wherever the
kernel that would run may not take GQA and SDPA would fall back to its math kernel:
- with an attention mask, or heads over 256 dims (as Hugging Face's SDPA path decides);
- fp32 on CUDA: the flash kernel is fp16/bf16 only, and the memory-efficient kernel that
  runs fp32 does not take grouped k/v (torch 2.11: only math would), so the repeated heads
  let the efficient kernel run. CPU's flash kernel takes grouped k/v in fp32, bf16 and
  fp16 alike.
`takes_grouped_kv` is the rule; the memory calculator asks it too.

`config.attention_backend` (Megatron's `--attention-backend`) restricts the kernels SDPA may
pick, with `torch.nn.attention.sdpa_kernel` around the call (`sdpa_backends`):

    auto     no restriction: SDPA chooses (Megatron: transformer-engine chooses)
    flash    FLASH_ATTENTION
    fused    CUDNN_ATTENTION, EFFICIENT_ATTENTION (Megatron's "fused" is cuDNN's fused kernel)
    unfused  MATH
    local    MATH (Megatron's local = its unfused PyTorch attention)

A restriction SDPA cannot meet raises ("No viable backend"): "fused" has kernels only on
CUDA (`attention_backend_needs_cuda`; the config cannot know the device, so the app refuses
it on a CPU run); "flash" runs on CUDA in fp16/bf16 only, and on the CPU through torch's CPU
flash kernel (any float dtype).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

MAX_GQA_HEAD_DIM = 256
# CUDA dtypes whose SDPA kernel (flash) takes grouped k/v; fp32 runs memory-efficient.
CUDA_GQA_DTYPES = (torch.float16, torch.bfloat16)

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
_SDPA_BACKENDS: dict[str, list[SDPBackend] | None] = {
    "auto": None,
    "flash": [SDPBackend.FLASH_ATTENTION],
    "fused": [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
    "unfused": [SDPBackend.MATH],
    "local": [SDPBackend.MATH],
}


def sdpa_backends(attention_backend: str) -> list[SDPBackend] | None:
    """The SDPA kernels `attention_backend` allows (None: SDPA's own choice)."""
    if attention_backend not in _SDPA_BACKENDS:
        raise ValueError(
            f"attention_backend={attention_backend!r}: the rule: one of {ATTENTION_BACKENDS}; "
            "fix: pick one of them"
        )
    return _SDPA_BACKENDS[attention_backend]


def attention_backend_needs_cuda(attention_backend: str) -> bool:
    """True for "fused": SDPA has cuDNN / memory-efficient kernels only on CUDA ("flash"
    also runs on the CPU, where torch has a flash kernel; "auto" and the math ones anywhere)."""
    backends = sdpa_backends(attention_backend)
    return (
        backends is not None
        and SDPBackend.FLASH_ATTENTION not in backends
        and (SDPBackend.MATH not in backends)
    )


def sdpa_backend_context(attention_backend: str) -> Any:
    """`sdpa_kernel(...)` restricting SDPA to `attention_backend`'s kernels, or a no-op."""
    backends = sdpa_backends(attention_backend)
    return contextlib.nullcontext() if backends is None else sdpa_kernel(backends)


def takes_grouped_kv(
    heads_per_group: int,
    has_mask: bool,
    head_dim: int,
    *,
    dtype: torch.dtype,
    device_type: str,
) -> bool:
    """Whether `grouped_sdpa` hands SDPA the g grouped k/v heads as they are.

    `device_type` is `torch.device.type` ("cuda", "cpu", ...); `dtype` that of q, k, v.
    """
    if heads_per_group <= 1 or has_mask or head_dim > MAX_GQA_HEAD_DIM:
        return False
    # Every device but the CPU follows CUDA's kernels (the fake GPU of the dry run too).
    return device_type == "cpu" or dtype in CUDA_GQA_DTYPES


def grouped_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    attention_backend: str = "auto",
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` for n query heads over g = n / rep k/v heads, on the
    kernels `attention_backend` allows (see the module docstring)."""
    rep = q.size(1) // k.size(1)
    gqa = takes_grouped_kv(
        rep, attn_mask is not None, q.size(-1), dtype=q.dtype, device_type=q.device.type
    )
    if rep > 1 and not gqa:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    with sdpa_backend_context(attention_backend):
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
