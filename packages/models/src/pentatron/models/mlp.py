"""MLP: fc1 (column-parallel) -> GeLU or SwiGLU -> fc2 (row-parallel).

For SwiGLU fc1's full weight is `cat([gate, up])` `[2 ffn, h]`; it is split with stride 2,
so tp rank r holds `cat([gate_r, up_r])` `[2 ffn / t, h]` and computes its own
`silu(gate_r) * up_r` with no communication.

    [s, b, h] (SP: [s/t, b, h]) -> fc1 (SP: all-gather(tp)) -> [s, b, (2) ffn / t]
      -> act -> [s, b, ffn / t] -> fc2 (all-reduce(tp); SP: reduce-scatter(tp)) -> [s(/t), b, h]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .activations import mlp_activation
from .config import TransformerConfig
from .spec import build_linear


@dataclass
class MLPSubmodules:
    linear_fc1: Any = None
    linear_fc2: Any = None


class MLP(torch.nn.Module):
    """`forward(x)` -> `(out, bias)`; fc2 skips its bias add (fused into bias-dropout-add)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        tp_group: Any = None,
        init_method: Any = None,
        output_layer_init_method: Any = None,
    ) -> None:
        super().__init__()
        self.config = config
        gated = config.gated_linear_unit
        assert config.ffn_hidden_size is not None, "TransformerConfig.__post_init__ sets it"
        fc1_out = config.ffn_hidden_size * (2 if gated else 1)
        self.linear_fc1 = build_linear(
            submodules.linear_fc1,
            config,
            config.hidden_size,
            fc1_out,
            tp_group=tp_group,
            bias=config.add_bias_linear,
            init_method=init_method,
            stride=2 if gated else 1,
            sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype,
        )
        self.linear_fc2 = build_linear(
            submodules.linear_fc2,
            config,
            config.ffn_hidden_size,
            config.hidden_size,
            tp_group=tp_group,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            init_method=output_layer_init_method,
            skip_bias_add=True,
            sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, _ = self.linear_fc1(x)
        return self.linear_fc2(mlp_activation(self.config, h))
