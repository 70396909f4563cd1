"""Normalisations: LayerNorm or RMSNorm, chosen by `config.normalization`.

Both compute in fp32 (tp-layers' `rms_norm` / `layer_norm`, which the fused norm+linear
of the TE-layout spec shares) and return the input dtype (or `params_dtype` with
`fp32_residual_connection`, where the residual stream is fp32 but the layers are not).
Shapes are unchanged: `[s, b, h]` (or `[s/t, b, h]` with sequence parallelism).

`config.layernorm_zero_centered_gamma` (Megatron's `--apply-layernorm-1p`, for LayerNorm and
RMSNorm as Megatron's transformer-engine norms): the weight is stored zero-centred,
initialised to 0, and the norm scales by `1 + weight` (formed in fp32, see tp-layers'
`norms`). Every norm built from the config follows it: input, pre-MLP, final and q/k norms.
"""

from __future__ import annotations

import torch

from pentatron.parallel_state import current_device
from pentatron.tp_layers import layer_norm, rms_norm

from .config import TransformerConfig


def _gamma_init(zero_centered_gamma: bool):
    return torch.zeros if zero_centered_gamma else torch.ones


class RMSNorm(torch.nn.Module):
    """`x / sqrt(mean(x^2) + eps) * weight` (Hugging Face Llama's order of casts);
    `* (1 + weight)` with `zero_centered_gamma` (weight `[h]` then starts at 0)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        dtype: torch.dtype,
        device=None,
        zero_centered_gamma: bool = False,
    ) -> None:
        super().__init__()
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        init = _gamma_init(zero_centered_gamma)
        self.weight = torch.nn.Parameter(
            init(hidden_size, dtype=dtype, device=device or current_device())
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[.., h]` -> `[.., h]`."""
        return rms_norm(x, self.weight, self.eps, self.zero_centered_gamma)


class LayerNorm(torch.nn.Module):
    """`torch.nn.functional.layer_norm` with weight and bias, computed in fp32; the scale is
    `1 + weight` with `zero_centered_gamma` (weight `[h]` then starts at 0)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        dtype: torch.dtype,
        device=None,
        zero_centered_gamma: bool = False,
    ) -> None:
        super().__init__()
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        device = device or current_device()
        init = _gamma_init(zero_centered_gamma)
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[.., h]` -> `[.., h]`."""
        return layer_norm(x, self.weight, self.bias, self.eps, self.zero_centered_gamma)


def Norm(
    config: TransformerConfig, hidden_size: int, eps: float | None = None, sequence_parallel=None
) -> torch.nn.Module:
    """The norm of `config.normalization` over the last dim of size `hidden_size`.

    `sequence_parallel` (default `config.sequence_parallel`) marks its parameters so their
    tp-partial grads are all-reduced (`sync_sequence_parallel_grads` / finalize_model_grads).
    """
    cls = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    norm = cls(
        hidden_size,
        config.layernorm_epsilon if eps is None else eps,
        config.params_dtype,
        zero_centered_gamma=config.layernorm_zero_centered_gamma,
    )
    sp = config.sequence_parallel if sequence_parallel is None else sequence_parallel
    for p in norm.parameters():
        p.sequence_parallel = bool(sp)  # type: ignore[attr-defined]  # a Parameter tag
    return norm
