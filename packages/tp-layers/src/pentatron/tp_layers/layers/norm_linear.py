"""`LayerNormColumnParallelLinear`: a norm fused into the column-parallel linear after it.

The PyTorch form of transformer-engine's `LayerNormLinear` (Megatron's
`TELayerNormColumnParallelLinear`), with its parameter names: `layer_norm_weight`
(+ `layer_norm_bias` for LayerNorm), `weight`, `bias`. The norm acts on this rank's input
before the linear's sequence-parallel all-gather, as TE's does:

    [s/t, b, in] (SP; else [s, b, in]) -> norm -> ColumnParallelLinear -> [s, b, out/t]

With sequence parallelism the norm's parameters see s/t of the tokens, so they are marked
`sequence_parallel` and their grads all-reduced over tp like a separate norm's.
`zero_centered_gamma=True` (TE's argument, Megatron's `layernorm_zero_centered_gamma`):
`layer_norm_weight` starts at 0 and the norm scales by `1 + layer_norm_weight`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..norms import check_normalization, layer_norm, rms_norm
from ..utils import TPConfigError
from .column import ColumnParallelLinear


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """`ColumnParallelLinear(norm(x))`; takes `ColumnParallelLinear`'s arguments plus
    `normalization` ("LayerNorm" | "RMSNorm"), `eps` and `zero_centered_gamma`."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        normalization: str = "LayerNorm",
        eps: float = 1e-5,
        zero_centered_gamma: bool = False,
        **kwargs: Any,
    ) -> None:
        check_normalization(normalization)
        if kwargs.get("skip_weight_param_allocation"):
            raise TPConfigError(
                "LayerNormColumnParallelLinear(skip_weight_param_allocation=True): the rule: "
                "the fused layer owns its weight; fix: use ColumnParallelLinear for a tied layer"
            )
        super().__init__(input_size, output_size, **kwargs)
        self.normalization, self.eps = normalization, eps
        self.zero_centered_gamma = zero_centered_gamma
        dtype = self.weight.dtype
        device = self.weight.device
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(init(input_size, dtype=dtype, device=device))
        sp = self.sequence_parallel
        # torch stubs lack .sequence_parallel
        self.layer_norm_weight.sequence_parallel = sp  # type: ignore[attr-defined]
        if normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(
                torch.zeros(input_size, dtype=dtype, device=device)
            )
            # torch stubs lack .sequence_parallel
            self.layer_norm_bias.sequence_parallel = sp  # type: ignore[attr-defined]
        else:
            self.register_parameter("layer_norm_bias", None)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None):
        """`[s, b, in]` (SP: `[s/t, b, in]`) -> `([s, b, out/t], bias)`."""
        if weight is not None:
            raise TPConfigError(
                "LayerNormColumnParallelLinear.forward(weight=...): the fused layer owns its "
                "weight; fix: use ColumnParallelLinear for a tied output layer"
            )
        zc = self.zero_centered_gamma
        if self.layer_norm_bias is None:
            x = rms_norm(x, self.layer_norm_weight, self.eps, zc)
        else:
            x = layer_norm(x, self.layer_norm_weight, self.layer_norm_bias, self.eps, zc)
        return super().forward(x)

    def extra_repr(self) -> str:
        zc = ", zero_centered_gamma=True" if self.zero_centered_gamma else ""
        return f"{self.normalization}(eps={self.eps}{zc}), " + super().extra_repr()
