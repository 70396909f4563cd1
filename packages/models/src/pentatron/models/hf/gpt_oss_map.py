"""Hugging Face gpt-oss (`GptOssForCausalLM`) <-> GPTModel: the config fields and the tensors
that differ from Llama's (attention projections, norms and embeddings map as in state_map).

GptOssConfig                          TransformerConfig
num_local_experts, num_experts_per_tok  num_moe_experts, moe_router_topk; every layer MoE
intermediate_size                     moe_ffn_hidden_size (= ffn_hidden_size)
router: logits + bias, top-k, softmax over the k   moe_router_pre_softmax=False
attention_bias=True                   add_bias_linear=True (attention, router and experts all
                                      carry biases in gpt-oss; attention_bias=False refused)
swiglu_limit                          activation="quick_geglu" (x sigmoid(1.702 x); swiglu_alpha
                                      other than 1.702 refused), glu_linear_offset=1.0,
                                      activation_func_clamp_value=swiglu_limit
self_attn.sinks (always)              softmax_type="learnable"
(keys left out take GptOssConfig's defaults: yarn x32 over 4096, window 128, 8 kv heads
of 64 dims, eps 1e-5, sliding / full alternating)
sliding_window, layer_types           window_size=(sliding_window - 1, 0) (HF's window counts the
                                      query's own key), window_attn_skip_freq: 2 for
                                      sliding / full alternating from layer 1 (gpt-oss's
                                      default), else a 0/1 list
rope_parameters yarn: factor,         position_embedding_type="yarn", rotary_scaling_factor,
  beta_fast, beta_slow, truncate,     yarn_beta_fast, yarn_beta_slow,
  original_max_position_embeddings,   yarn_correction_range_round_to_int,
  mscale + mscale_all_dim | attention_factor   yarn_original_max_position_embeddings, mscale,
                                      mscale_all_dim (an attention factor a becomes
                                      mscale=(a - 1) / (0.1 ln factor), mscale_all_dim=0)
rope_parameters default               position_embedding_type="rope"
router_aux_loss_coef                  moe_aux_loss_coeff

Tensors of global layer i, E experts, F = moe_ffn_hidden_size:

    ours (decoder.layers.{i}.)                    HF (model.layers.{i}.)
    self_attention.core_attention.softmax_offset [n]   self_attn.sinks [n] (tp: by heads)
    mlp.router.weight [E, h], mlp.router.bias [E] mlp.router.weight, mlp.router.bias
    mlp.experts.linear_fc1.weight [E, 2F, h]      mlp.experts.gate_up_proj [E, h, 2F], transposed;
                                                  HF's columns interleave gate and up (2j: gate
                                                  j, 2j + 1: up j), ours are [gate; up]
    mlp.experts.linear_fc1.bias [E, 2F]           mlp.experts.gate_up_proj_bias [E, 2F] (interleaved)
    mlp.experts.linear_fc2.weight [E, h, F]       mlp.experts.down_proj [E, F, h], transposed
    mlp.experts.linear_fc2.bias [E, h]            mlp.experts.down_proj_bias [E, h]

OpenAI's release stores the two expert weights in MXFP4 (`mxfp4.py`): `gate_up_proj_blocks`
/ `_scales` dequantise to `[E, 2F, h]` (rows interleaved, not transposed), `down_proj_blocks`
/ `_scales` to `[E, h, F]`. Reading takes either form; writing gives the unquantised one
(`save_pretrained`'s in bf16 / fp32), which transformers loads without a quantiser.

Sharded reads: ep rank r takes experts r E/ep ... (r+1) E/ep - 1 and etp rank q the columns
c0 .. c1 of F: of gate_up that is HF's columns [2 c0, 2 c1) (gate and up interleaved: one
box), of down HF's rows [c0, c1). MXFP4 boxes are read the same way (down's columns in whole
blocks of 32 where the split allows, else the rows whole and sliced after).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..config import TransformerConfig
from ..rope import yarn_concentration
from .errors import HFConfigError, fail
from .moe_map import _part  # ep / etp ranges, as for the other MoE forms
from .mxfp4 import BLOCK, dequantize_mxfp4

ARCHITECTURE = "GptOssForCausalLM"
QUICK_GELU_ALPHA = 1.702  # quick-GeGLU's sigmoid gain, fixed in Megatron's and ours
SINKS_SUFFIX = "self_attention.core_attention.softmax_offset"
SINKS_HF = "self_attn.sinks"
_SLIDING, _FULL = "sliding_attention", "full_attention"
# GptOssConfig's defaults for keys a config.json may leave out (transformers fills them in)
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
DEFAULTS = {
    "sliding_window": 128,
    "head_dim": 64,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "router_aux_loss_coef": 0.001,
}
_EXPERTS = {  # our mlp.<suffix> -> HF mlp.experts.<name>
    "experts.linear_fc1.weight": "gate_up_proj",
    "experts.linear_fc1.bias": "gate_up_proj_bias",
    "experts.linear_fc2.weight": "down_proj",
    "experts.linear_fc2.bias": "down_proj_bias",
}


# ---- config ------------------------------------------------------------------------------


def gpt_oss_fields_from_hf(d: dict[str, Any]) -> dict[str, Any]:
    """TransformerConfig keyword arguments of a gpt-oss config dict (beyond Llama's)."""
    if not d.get("attention_bias", True):
        fail(
            "attention_bias",
            False,
            "Megatron's add_bias_linear puts biases on attention and MLP alike, and gpt-oss's "
            "router and experts always have them",
            "convert a gpt-oss checkpoint with attention_bias=True",
        )
    alpha = float(d.get("swiglu_alpha", QUICK_GELU_ALPHA))
    if alpha != QUICK_GELU_ALPHA:
        fail(
            "swiglu_alpha",
            alpha,
            f"quick-GeGLU's sigmoid gain is {QUICK_GELU_ALPHA} (Megatron's --quick-geglu)",
            f"use swiglu_alpha={QUICK_GELU_ALPHA}",
        )
    quant = d.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "mxfp4":
        fail(
            "quantization_config.quant_method",
            quant.get("quant_method"),
            "gpt-oss checkpoints are read unquantised or in MXFP4",
            "dequantise the checkpoint first",
        )
    experts, topk = int(d.get("num_local_experts") or 0), int(d.get("num_experts_per_tok", 4))
    if experts < 1:
        fail("num_local_experts", experts, "gpt-oss's layers are all MoE", "use >= 1")
    ffn = int(d["intermediate_size"])
    heads = d["num_attention_heads"]
    return {
        "num_query_groups": d.get("num_key_value_heads", DEFAULTS["num_key_value_heads"]) or heads,
        "kv_channels": d.get("head_dim", DEFAULTS["head_dim"]) or d["hidden_size"] // heads,
        "layernorm_epsilon": float(d.get("rms_norm_eps", DEFAULTS["rms_norm_eps"])),
        "ffn_hidden_size": ffn,
        "moe_ffn_hidden_size": ffn,
        "moe_layer_freq": 1,
        "num_moe_experts": experts,
        "moe_router_topk": topk,
        "moe_router_pre_softmax": False,
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(
            d.get("router_aux_loss_coef", DEFAULTS["router_aux_loss_coef"])
        ),
        "add_bias_linear": True,
        "add_qkv_bias": True,
        "activation": "quick_geglu",
        "glu_linear_offset": 1.0,
        "activation_func_clamp_value": float(d.get("swiglu_limit", 7.0)),
        "softmax_type": "learnable",
        **_window_from_hf(d),
        **_rope_from_hf(d),
    }


def _default_layer_types(layers: int) -> list[str]:
    """GptOssConfig's default (and Megatron's --window-attn-skip-freq 2): layer 1 sliding,
    layer 2 full, ..."""
    return [_SLIDING if (i + 1) % 2 else _FULL for i in range(layers)]


def _window_from_hf(d: dict[str, Any]) -> dict[str, Any]:
    layers = d["num_hidden_layers"]
    types = d.get("layer_types") or _default_layer_types(layers)
    if len(types) != layers or set(types) - {_SLIDING, _FULL}:
        fail(
            "layer_types",
            types,
            f"{layers} entries of {_SLIDING!r} / {_FULL!r}",
            "fix config.json's layer_types",
        )
    window = d.get("sliding_window", DEFAULTS["sliding_window"])
    sliding = [int(t == _SLIDING) for t in types]
    if window is None or not any(sliding):
        return {"window_size": None, "window_attn_skip_freq": None}
    if int(window) < 1:
        fail("sliding_window", window, "a window holds at least the query's own key", "use >= 1")
    if sliding == [int(t == _SLIDING) for t in _default_layer_types(layers)] and layers > 1:
        freq: int | list[int] | None = 2
    else:
        freq = None if all(sliding) else sliding
    return {"window_size": (int(window) - 1, 0), "window_attn_skip_freq": freq}


def _rope_from_hf(d: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 fills rope_parameters in; transformers 4's rope_scaling=None is plain
    # RoPE; neither key: GptOssConfig's default
    if d.get("rope_parameters") is not None:
        params = dict(d["rope_parameters"])
    elif "rope_scaling" in d:
        params = dict(d["rope_scaling"] or {})
    else:
        params = dict(DEFAULT_ROPE)
    theta = float(params.get("rope_theta", d.get("rope_theta", 150000.0)))
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        fail("partial_rotary_factor", partial, "gpt-oss rotates the whole head", "use 1.0")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"position_embedding_type": "rope", "rotary_base": theta}
    if kind != "yarn":
        fail("rope_parameters.rope_type", kind, "gpt-oss takes default or yarn RoPE", "use yarn")
    if "original_max_position_embeddings" not in params:
        fail(
            "rope_parameters.original_max_position_embeddings",
            None,
            "yarn needs the pre-training context length",
            "add it (gpt-oss: 4096)",
        )
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or d["max_position_embeddings"] / original  # HF's default
    mscale, mscale_all_dim = _yarn_mscales(params, float(factor))
    return {
        "position_embedding_type": "yarn",
        "rotary_base": theta,
        "rotary_scaling_factor": float(factor),
        "yarn_original_max_position_embeddings": original,
        "yarn_beta_fast": float(params.get("beta_fast") or 32.0),
        "yarn_beta_slow": float(params.get("beta_slow") or 1.0),
        "yarn_correction_range_round_to_int": bool(params.get("truncate", True)),
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
    }


def _yarn_mscales(params: dict[str, Any], factor: float) -> tuple[float, float]:
    """(mscale, mscale_all_dim) giving transformers' attention factor on cos and sin: an
    explicit `attention_factor`; else both mscales when both are set (and non-zero); else
    `0.1 ln(factor) + 1` = our (1, 0)."""
    explicit = params.get("attention_factor")
    if explicit is not None:
        if factor <= 1.0:
            if float(explicit) != 1.0:
                fail(
                    "rope_parameters.attention_factor",
                    explicit,
                    "with factor <= 1 YaRN scales cos and sin by 1",
                    "drop it",
                )
            return 1.0, 0.0
        return (float(explicit) - 1.0) / (0.1 * math.log(factor)), 0.0
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and all_dim:
        return float(mscale), float(all_dim)
    return 1.0, 0.0


def check_gpt_oss_representable(config: TransformerConfig) -> None:
    """Refuse what GptOssForCausalLM cannot express (it would change the logits)."""
    pattern = config.moe_layer_pattern() if config.is_moe else [False]
    rules: tuple[tuple[str, Any, Any], ...] = (
        ("num_moe_experts (every layer MoE)", all(pattern), True),
        ("normalization", config.normalization, "RMSNorm"),
        ("qk_layernorm", config.qk_layernorm, False),
        ("add_bias_linear", config.add_bias_linear, True),
        ("glu_linear_offset", config.glu_linear_offset, 1.0),
        ("softmax_type", config.softmax_type, "learnable"),
        ("rotary_percent", config.rotary_percent, 1.0),
        ("rope_scaling", config.rope_scaling, None),
        ("mtp_num_layers", config.mtp_num_layers, None),
        ("moe_router_score_function", config.moe_router_score_function, "softmax"),
        ("moe_router_pre_softmax", config.moe_router_pre_softmax, False),
        ("moe_router_topk_scaling_factor", config.moe_router_topk_scaling_factor, None),
        ("moe_router_group_topk", config.moe_router_group_topk, None),
        ("moe_router_enable_expert_bias", config.moe_router_enable_expert_bias, False),
        ("moe_expert_capacity_factor", config.moe_expert_capacity_factor, None),
        ("moe_shared_expert_intermediate_size", config.moe_shared_expert_intermediate_size, None),
    )
    for name, value, want in rules:
        if value != want:
            raise HFConfigError(
                f"TransformerConfig {name}={value!r}: {ARCHITECTURE} needs {name}={want!r}; "
                "fix: only models of gpt-oss's shape export to it"
            )
    if config.position_embedding_type not in ("rope", "yarn"):
        raise HFConfigError(
            f"TransformerConfig position_embedding_type={config.position_embedding_type!r}: "
            f"{ARCHITECTURE} needs 'rope' or 'yarn'; fix: only models of gpt-oss's shape "
            "export to it"
        )
    if config.activation_func_clamp_value is None:
        raise HFConfigError(
            f"TransformerConfig activation_func_clamp_value=None: {ARCHITECTURE} always clamps "
            "(swiglu_limit); fix: set activation_func_clamp_value (gpt-oss: 7.0)"
        )


def gpt_oss_to_hf_fields(config: TransformerConfig, rope_parameters: bool) -> dict[str, Any]:
    """The gpt-oss fields of the HF config dict of `config` (over Llama's)."""
    check_gpt_oss_representable(config)
    layers = range(1, config.num_layers + 1)
    windowed = [config.is_window_attention_layer(n) for n in layers]
    window = config.window_size
    rope = _rope_to_hf(config)
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "gpt_oss",
        "intermediate_size": config.moe_ffn_size,
        "num_local_experts": config.num_moe_experts,
        "num_experts_per_tok": config.moe_router_topk,
        "router_aux_loss_coef": config.moe_aux_loss_coeff,
        "attention_bias": True,
        "swiglu_alpha": QUICK_GELU_ALPHA,
        "swiglu_limit": config.activation_func_clamp_value,
        "sliding_window": window[0] + 1 if window is not None and any(windowed) else None,
        "layer_types": [_SLIDING if w else _FULL for w in windowed],
    }
    if rope_parameters:
        d["rope_parameters"] = rope
    else:  # transformers 4's form of the same RoPE
        d["rope_theta"] = rope.pop("rope_theta")
        d["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    return d


def _rope_to_hf(config: TransformerConfig) -> dict[str, Any]:
    if config.position_embedding_type == "rope":
        return {"rope_type": "default", "rope_theta": config.rotary_base}
    rope = {
        "rope_type": "yarn",
        "rope_theta": config.rotary_base,
        "factor": config.rotary_scaling_factor,
        "beta_fast": config.yarn_beta_fast,
        "beta_slow": config.yarn_beta_slow,
        "truncate": config.yarn_correction_range_round_to_int,
        "original_max_position_embeddings": config.yarn_original_max_position_embeddings,
    }
    if (config.mscale, config.mscale_all_dim) != (1.0, 0.0):
        # transformers reads mscales only in pairs of non-zero values: give the factor itself
        rope["attention_factor"] = yarn_concentration(config)
    return rope


# ---- tensors -----------------------------------------------------------------------------


def gpt_oss_hf_names(suffix: str, layer: int) -> list[str]:
    """The HF tensor of our MoE parameter `mlp.<suffix>` of global layer `layer`."""
    pre = f"model.layers.{layer}.mlp."
    if suffix in ("router.weight", "router.bias"):
        return [pre + suffix]
    if suffix in _EXPERTS:
        return [pre + "experts." + _EXPERTS[suffix]]
    raise KeyError(
        f"decoder.layers.{layer}.mlp.{suffix}: no Hugging Face gpt-oss counterpart; the rule: "
        "router.weight / bias and experts.linear_fc1 / fc2 weight and bias; fix: convert a "
        "model without shared experts or the expert bias buffer"
    )


def deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """HF's interleaved gate / up along `dim` (g0 u0 g1 u1 ...) -> ours (g0 g1 ... u0 u1 ...)."""
    x = t.movedim(dim, -1)
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1).movedim(-1, dim)


def interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Ours (gate rows, then up) along `dim` -> HF's interleaved g0 u0 g1 u1 ..."""
    gate, up = torch.chunk(t, 2, dim=dim)
    return torch.stack((gate, up), dim=dim + 1).flatten(dim, dim + 1)


def read_gpt_oss_moe_shard(
    suffix: str,
    layer: int,
    src: Any,
    config: TransformerConfig,
    *,
    ep_rank: int,
    ep_size: int,
    etp_rank: int,
    etp_size: int,
) -> torch.Tensor:
    """This rank's part of `decoder.layers.{layer}.mlp.<suffix>`, reading only its slices.

    router weight `[E, h]` and bias `[E]` whole; experts fc1 weight `[E/ep, 2F/etp, h]`
    (`[gate_q; up_q]`) and bias `[E/ep, 2F/etp]`, fc2 weight `[E/ep, h, F/etp]`, fc2 bias
    `[E/ep, h]`.
    """
    (name,) = gpt_oss_hf_names(suffix, layer)
    if suffix.startswith("router."):
        return src.read(name)
    experts = config.num_moe_experts
    assert experts is not None, "expert parameters exist only when num_moe_experts is set"
    e = _part(experts, ep_rank, ep_size, "num_moe_experts")
    c0, c1 = _part(config.moe_ffn_size, etp_rank, etp_size, "moe_ffn_hidden_size")
    if suffix == "experts.linear_fc1.bias":
        return deinterleave(src.read_box(name, [e, (2 * c0, 2 * c1)]), 1)
    if suffix == "experts.linear_fc2.bias":
        return src.read_box(name, [e])
    fc1, keys = suffix == "experts.linear_fc1.weight", src.keys()
    if name in keys:  # [E, h, 2F] / [E, F, h]: ours transposed
        if fc1:
            return deinterleave(src.read_box(name, [e, None, (2 * c0, 2 * c1)]), 2).transpose(1, 2)
        return src.read_box(name, [e, (c0, c1)]).transpose(1, 2)
    if name + "_blocks" not in keys:
        raise KeyError(
            f"Hugging Face tensors have neither {name!r} nor {name + '_blocks'!r}; the rule: "
            "a gpt-oss checkpoint, unquantised or MXFP4; fix: check it against its config.json"
        )
    if fc1:  # [E, 2F, h]: rows interleaved
        return deinterleave(_read_mxfp4(src, name, [e, (2 * c0, 2 * c1)]), 1)
    if c0 % BLOCK == 0 and c1 % BLOCK == 0:  # [E, h, F]: F in whole blocks
        return _read_mxfp4(src, name, [e, None, (c0 // BLOCK, c1 // BLOCK)])
    return _read_mxfp4(src, name, [e])[..., c0:c1]


def _read_mxfp4(src: Any, name: str, box: list[tuple[int, int] | None]) -> torch.Tensor:
    blocks = src.read_box(name + "_blocks", box)
    scales = src.read_box(name + "_scales", box)
    return dequantize_mxfp4(blocks, scales)


def gpt_oss_moe_full_to_hf(suffix: str, layer: int, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A full (tp = ep = 1) MoE parameter -> its HF tensor."""
    (name,) = gpt_oss_hf_names(suffix, layer)
    if suffix == "experts.linear_fc1.weight":
        return {name: interleave(t, 1).transpose(1, 2)}
    if suffix == "experts.linear_fc1.bias":
        return {name: interleave(t, 1)}
    if suffix == "experts.linear_fc2.weight":
        return {name: t.transpose(1, 2)}
    return {name: t}
