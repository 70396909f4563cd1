"""`TransformerLayer`: pre-norm self-attention and MLP, each with a residual.

x [s, b, h] (SP: [s/t, b, h])
  -> input_layernorm -> self_attention -> + bias, dropout, + x   (bias-dropout-add)
  -> pre_mlp_layernorm -> mlp -> + bias, dropout, + residual
-> [s, b, h] (SP: [s/t, b, h])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pentatron.tp_layers import init_method_normal, scaled_init_method_normal

from .config import TransformerConfig
from .spec import build_module


@dataclass
class TransformerLayerSubmodules:
    input_layernorm: Any = None
    self_attention: Any = None
    pre_mlp_layernorm: Any = None
    mlp: Any = None
    moe_mlp: Any = None  # built instead of `mlp` where config.moe_layer_pattern() is True


def init_methods(config: TransformerConfig) -> tuple[Any, Any]:
    """(init_method, output_layer_init_method): N(0, std^2) and its 1/sqrt(2L) scaled form."""
    init = init_method_normal(config.init_method_std)
    if not config.scaled_output_init:
        return init, init
    return init, scaled_init_method_normal(config.init_method_std, config.num_layers)


def bias_dropout_add(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    """`residual + dropout(x + bias)`."""
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=p, training=training)


class TransformerLayer(torch.nn.Module):
    """One decoder layer; `layer_number` is global and 1-based (Megatron's convention)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules,
        layer_number: int,
        tp_group: Any = None,
        tp_size: int = 1,
        parallel: Any = None,
    ) -> None:
        super().__init__()
        self.config, self.layer_number = config, layer_number
        self.parallel = parallel  # the model's ModelParallel (groups for MoE and FP8), or None
        init, out_init = init_methods(config)
        h = config.hidden_size
        self.input_layernorm = build_module(submodules.input_layernorm, config, h)
        self.self_attention = build_module(
            submodules.self_attention,
            config,
            layer_number=layer_number,
            tp_group=tp_group,
            tp_size=tp_size,
            init_method=init,
            output_layer_init_method=out_init,
        )
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, config, h)
        self.mlp = self._build_mlp(submodules, tp_group, parallel, init, out_init)

    def _build_mlp(self, submodules, tp_group, parallel, init, out_init) -> Any:
        """The dense MLP, or the MoE layer where `config.moe_layer_pattern()` says so."""
        config = self.config
        if not config.moe_layer_pattern()[self.layer_number - 1]:
            return build_module(
                submodules.mlp,
                config,
                tp_group=tp_group,
                init_method=init,
                output_layer_init_method=out_init,
            )
        if submodules.moe_mlp is None:
            raise ValueError(
                f"layer {self.layer_number} is a MoE layer (moe_layer_freq) but the layer "
                "spec has no moe_mlp; the rule: MoE layers need a spec entry; fix: use "
                "get_gpt_layer_local_spec() or set TransformerLayerSubmodules.moe_mlp"
            )
        return build_module(
            submodules.moe_mlp,
            config,
            layer_number=self.layer_number,
            parallel=parallel,
            tp_group=tp_group,
            init_method=init,
            output_layer_init_method=out_init,
        )

    def forward(
        self, hidden: torch.Tensor, attention_mask: Any = None, rotary: Any = None
    ) -> torch.Tensor:
        """`[s, b, h]` (SP: `[s/t, b, h]`) -> same shape."""
        p, training = self.config.hidden_dropout, self.training
        out, bias = self.self_attention(self.input_layernorm(hidden), attention_mask, rotary)
        hidden = bias_dropout_add(out, bias, hidden, p, training)
        out, bias = self.mlp(self.pre_mlp_layernorm(hidden))
        return bias_dropout_add(out, bias, hidden, p, training)
