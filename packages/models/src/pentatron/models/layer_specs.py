"""Layer specs for GPT: the local one (PyTorch + tp-layers) and the transformer-engine one.

`get_gpt_layer_local_spec()` works everywhere. `get_gpt_layer_te_spec()` needs
transformer-engine (see `te_spec.py`) and raises `ModelConfigError` naming the fix when it
is missing; `get_gpt_layer_te_spec(backend="torch")` builds its layout in PyTorch. The TE
layout names the fused norms as Megatron does (`linear_qkv.layer_norm_weight`);
`global_param_name` maps them to the local spec's names, and each layer loads either.
"""

from __future__ import annotations

from pentatron.tp_layers import ColumnParallelLinear, DuplicatedLinear, RowParallelLinear

from .attention import DotProductAttention, SelfAttention, SelfAttentionSubmodules
from .mla import MLASelfAttention, MLASelfAttentionSubmodules
from .mlp import MLP, MLPSubmodules
from .moe.moe_layer import MoELayer, MoESubmodules
from .norm import Norm
from .spec import ModuleSpec
from .transformer_layer import TransformerLayer, TransformerLayerSubmodules


def get_gpt_layer_local_spec(
    qk_layernorm: bool = True, multi_latent_attention: bool = False
) -> ModuleSpec:
    """Spec of one GPT layer from PyTorch and tp-layers modules.

    `qk_layernorm=False` removes the q/k norms from the spec; with True they are built
    only when `config.qk_layernorm` is set. Layers that `config.moe_layer_pattern()` marks
    build `moe_mlp` (MoELayer: TopKRouter, experts by `moe_grouped_gemm`) instead of `mlp`.
    `multi_latent_attention`: MLASelfAttention (see mla.py; its latent norms are the q/k
    norms, as Megatron's; its down-projections duplicated over tp, as Megatron's
    transformer-engine spec builds them) for a config with `multi_latent_attention=True`.
    """
    qk_norm = Norm if qk_layernorm else None
    attention = ModuleSpec(
        module=SelfAttention,
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=DotProductAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=qk_norm,
            k_layernorm=qk_norm,
        ),
    )
    if multi_latent_attention:
        attention = ModuleSpec(
            module=MLASelfAttention,
            submodules=MLASelfAttentionSubmodules(
                linear_q_proj=ColumnParallelLinear,
                linear_q_down_proj=DuplicatedLinear,
                linear_q_up_proj=ColumnParallelLinear,
                linear_kv_down_proj=DuplicatedLinear,
                linear_kv_up_proj=ColumnParallelLinear,
                core_attention=DotProductAttention,
                linear_proj=RowParallelLinear,
                q_layernorm=qk_norm,
                kv_layernorm=qk_norm,
            ),
        )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=Norm,
            self_attention=attention,
            pre_mlp_layernorm=Norm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(
                    linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
                ),
            ),
            moe_mlp=ModuleSpec(module=MoELayer, submodules=MoESubmodules()),
        ),
    )


def get_gpt_layer_te_spec(qk_layernorm: bool = True, backend: str = "te") -> ModuleSpec:
    """The transformer-engine spec: norms fused into the next linear (parameters named
    `layer_norm_weight`, as Megatron's), TE linears and core attention, FP8 autocast when
    `config.fp8`. `backend="torch"`: the same layout and names in PyTorch (see te_spec)."""
    from .te_spec import te_layer_spec

    return te_layer_spec(qk_layernorm, backend)
