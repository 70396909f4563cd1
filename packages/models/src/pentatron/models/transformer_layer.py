"""`TransformerLayer`: pre-norm self-attention and MLP, each with a residual.

x [s, b, h] (SP: [s/t, b, h])
  -> input_layernorm -> self_attention -> + bias, dropout, + x   (bias-dropout-add)
  -> pre_mlp_layernorm -> mlp -> + bias, dropout, + residual
-> [s, b, h] (SP: [s/t, b, h])

Selective recompute (`recompute_modules`, see recompute.py): "layernorm" checkpoints both
norms and frees their outputs once attention / the MLP has run ("output-discarding", as
Megatron; a norm fused into the next linear, the TE layout's Identity, is not); "mlp"
checkpoints a dense layer's MLP (a MoE layer's is "moe", in MoELayer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pentatron.tp_layers import checkpoint, init_method_normal, scaled_init_method_normal

from .config import ModelConfigError, TransformerConfig
from .recompute import CheckpointWithoutOutput, recompute_now
from .sharding import FUSED_NORMS
from .spec import build_module


@dataclass
class TransformerLayerSubmodules:
    input_layernorm: Any = None
    self_attention: Any = None
    pre_mlp_layernorm: Any = None
    mlp: Any = None
    moe_mlp: Any = None  # built instead of `mlp` where config.moe_layer_pattern() is True
    # The norm before `moe_mlp` where it differs from `pre_mlp_layernorm` (the TE spec fuses
    # the dense MLP's norm into linear_fc1; a MoE layer's router needs it separate).
    moe_pre_mlp_layernorm: Any = None


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
    """One decoder layer; `layer_number` is global and 1-based (Megatron's convention).

    Loads a state dict of either layout: local (`input_layernorm.weight`) or TE
    (`self_attention.linear_qkv.layer_norm_weight`), renaming the norm keys to its own.
    """

    runs_fp8 = False  # the TE spec's layer runs under fp8_autocast

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
        if config.fp8 is not None and not self.runs_fp8:
            raise ModelConfigError(
                f"fp8={config.fp8!r} with {type(self).__name__}: the rule: FP8 runs only in "
                "the transformer-engine spec's layer; fix: get_gpt_layer_te_spec() (with "
                "transformer-engine on CUDA), or fp8=None"
            )
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
        self.is_moe_layer = moe = config.is_moe_layer(layer_number)
        norm = submodules.moe_pre_mlp_layernorm if moe else None
        self.pre_mlp_layernorm = build_module(norm or submodules.pre_mlp_layernorm, config, h)
        self.mlp = self._build_mlp(submodules, tp_group, parallel, init, out_init)
        # the private form: torch 2.4 (our floor) has no public load-state-dict pre-hook
        self._register_load_state_dict_pre_hook(self._rename_norm_keys)

    def _rename_norm_keys(self, state_dict: dict, prefix: str, *_: Any) -> None:
        """Rename the other layout's norm keys in `state_dict` to this layer's names."""
        own = {name for name, _ in self.named_parameters()}
        for local, fused in FUSED_NORMS.items():
            for kind in ("weight", "bias"):
                for theirs, ours in ((local + kind, fused + kind), (fused + kind, local + kind)):
                    if ours in own and theirs not in own and prefix + theirs in state_dict:
                        state_dict[prefix + ours] = state_dict.pop(prefix + theirs)

    def _build_mlp(self, submodules, tp_group, parallel, init, out_init) -> Any:
        """The dense MLP, or the MoE layer where `config.moe_layer_pattern()` says so."""
        config = self.config
        if not config.is_moe_layer(self.layer_number):
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
        normed, norm_ckpt = self._norm(self.input_layernorm, hidden)
        out, bias = self.self_attention(normed, attention_mask, rotary)
        if norm_ckpt is not None:
            norm_ckpt.discard_output_and_register_recompute(out)
        hidden = bias_dropout_add(out, bias, hidden, p, training)
        normed, norm_ckpt = self._norm(self.pre_mlp_layernorm, hidden)
        out, bias = self._mlp(normed)
        if norm_ckpt is not None:
            norm_ckpt.discard_output_and_register_recompute(out)
        return bias_dropout_add(out, bias, hidden, p, training)

    def _norm(
        self, norm: torch.nn.Module, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, CheckpointWithoutOutput | None]:
        """`norm(hidden)`, output-discarding checkpointed with "layernorm" recompute."""
        if isinstance(norm, torch.nn.Identity) or not recompute_now(
            self.config, "layernorm", self.training
        ):
            return norm(hidden), None
        ckpt = CheckpointWithoutOutput()
        return ckpt.checkpoint(norm, hidden), ckpt

    def _mlp(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MLP, checkpointed with "mlp" recompute on a dense layer (MoE: see MoELayer)."""
        if self.is_moe_layer or not recompute_now(self.config, "mlp", self.training):
            return self.mlp(hidden)
        bias: list[torch.Tensor | None] = []

        def run(x: torch.Tensor) -> torch.Tensor:
            out, b = self.mlp(x)
            bias[:] = [b]  # the bias parameter itself: kept out of the checkpoint's outputs
            return out

        out = checkpoint(run, hidden)
        return out, bias[0]
