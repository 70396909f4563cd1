"""Shared experts: a dense, tp-split MLP that every token passes through beside the routed
experts (DeepSeek / Qwen2-MoE), optionally scaled by a sigmoid gate.

    x [s/t, b, h] -> MLP (ffn = moe_shared_expert_intermediate_size, split over tp like the
    dense MLP) -> [s/t, b, h]  (* sigmoid(x @ gate_weight^T) when moe_shared_expert_gate)

`gate_weight [1, h]` is replicated over tp and sees only this rank's tokens under sequence
parallelism, so it is marked `sequence_parallel` (its grad is all-reduced over tp).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pentatron.parallel_state import current_device
from pentatron.tp_layers import ColumnParallelLinear, RowParallelLinear, mark_sequence_parallel

from ..mlp import MLP, MLPSubmodules


class SharedExpertMLP(MLP):
    """`forward(x)` -> `[s/t, b, h]` (bias added, gate applied)."""

    def __init__(
        self,
        config: Any,
        submodules: MLPSubmodules | None = None,
        tp_group: Any = None,
        init_method: Any = None,
        output_layer_init_method: Any = None,
    ) -> None:
        shared = dataclasses.replace(
            config, ffn_hidden_size=config.moe_shared_expert_intermediate_size
        )
        submodules = submodules or MLPSubmodules(ColumnParallelLinear, RowParallelLinear)
        super().__init__(shared, submodules, tp_group, init_method, output_layer_init_method)
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            self.gate_weight = torch.nn.Parameter(
                torch.empty(
                    1, config.hidden_size, dtype=config.params_dtype, device=current_device()
                )
            )
            if init_method is not None:
                init_method(self.gate_weight)
            if config.sequence_parallel:
                mark_sequence_parallel(self.gate_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out, bias = super().forward(x)
        if bias is not None:
            out = out + bias
        if self.gate_weight is not None:
            out = out * torch.sigmoid(torch.nn.functional.linear(x, self.gate_weight))
        return out
