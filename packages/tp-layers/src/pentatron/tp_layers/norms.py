"""LayerNorm and RMSNorm as functions, computed in fp32 and returned in the weight's dtype.

One definition serves the fused norm+linear layer here and pentatron.models' norm modules,
so a norm fused into a linear has the numbers of the separate norm it replaces. Shapes are
unchanged over the last dim `h`: `[s, b, h]` (or `[s/t, b, h]` with sequence parallelism).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .utils import TPConfigError

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(normalization: str) -> None:
    """Raise `TPConfigError` unless `normalization` is one of `NORMALIZATIONS`."""
    if normalization not in NORMALIZATIONS:
        raise TPConfigError(
            f"normalization={normalization!r}: the rule: one of {', '.join(NORMALIZATIONS)}; "
            "fix: pass normalization='LayerNorm' or 'RMSNorm'"
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * weight` (Hugging Face Llama's order of casts)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(weight.dtype)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """`torch.nn.functional.layer_norm` with weight and bias, computed in fp32."""
    out = F.layer_norm(x.to(torch.float32), (weight.numel(),), weight.float(), bias.float(), eps)
    return out.to(weight.dtype)
