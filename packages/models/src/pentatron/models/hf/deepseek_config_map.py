"""Hugging Face DeepSeek-V3 config <-> the fields of `TransformerConfig`, both ways.

DeepseekV3Config                      TransformerConfig
q_lora_rank (None: q direct)          q_lora_rank; multi_latent_attention=True,
                                      qk_layernorm=True (HF always has the latent norms)
kv_lora_rank                          kv_lora_rank
qk_nope_head_dim, qk_rope_head_dim    qk_head_dim, qk_pos_emb_head_dim
v_head_dim                            v_head_dim
rope yarn: factor, mscale,            rotary_scaling_factor, mscale, mscale_all_dim,
  mscale_all_dim, beta_fast,          yarn_beta_fast, yarn_beta_slow,
  beta_slow, original_max_...         yarn_original_max_position_embeddings
rope_interleave=True                  (our MLA rotates DeepSeek's interleaved pairs)
intermediate_size                     ffn_hidden_size (the first_k_dense_replace dense layers)
first_k_dense_replace                 moe_layer_freq = [0] * k + [1] * (L - k)
n_routed_experts, num_experts_per_tok num_moe_experts, moe_router_topk
moe_intermediate_size                 moe_ffn_hidden_size
n_shared_experts                      moe_shared_expert_intermediate_size = n * moe_ffn
n_group, topk_group                   moe_router_num_groups, moe_router_group_topk
routed_scaling_factor                 moe_router_topk_scaling_factor
sigmoid scores, norm_topk_prob=True,  moe_router_score_function="sigmoid",
  e_score_correction_bias             moe_router_enable_expert_bias=True (fp32 router)
num_nextn_predict_layers              mtp_num_layers, only where the checkpoint holds the
                                      MTP layers (`model.layers.{L + k}`; transformers drops
                                      them, DeepSeek's release has them)

Refused by name: rope_interleave=False, rms_norm_eps other than 1e-6 (transformers' latent
norms use 1e-6 whatever the config, ours the config's eps), attention_bias, scores other
than sigmoid with the bias (`noaux_tc`), norm_topk_prob=False, a group score other than
the sum of each group's top 2 (DeepSeek's; Megatron's sums the top topk / group_topk).
"""

from __future__ import annotations

from typing import Any

from ..config import TransformerConfig
from .errors import HFConfigError, fail

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default for q_a / kv_a norms


def _rope_fields(d: dict[str, Any]) -> dict[str, Any]:
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rotary_base": theta}
    if kind == "default":
        return out
    if kind != "yarn":
        fail(
            "rope_parameters.rope_type", kind, "DeepSeek-V3 takes default or yarn RoPE", "use yarn"
        )
    out.update(
        rotary_scaling_factor=float(params["factor"]),
        mscale=float(params.get("mscale", 1.0)),
        mscale_all_dim=float(params.get("mscale_all_dim", 0.0)),
        yarn_beta_fast=float(params.get("beta_fast", 32.0)),
        yarn_beta_slow=float(params.get("beta_slow", 1.0)),
        yarn_original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
    return out


def _moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    layers, k = d["num_hidden_layers"], int(d.get("first_k_dense_replace", 0) or 0)
    if k >= layers:
        return {}  # every layer dense
    if d.get("scoring_func", "sigmoid") != "sigmoid" or d.get("topk_method", "noaux_tc") != (
        "noaux_tc"
    ):
        fail(
            "scoring_func",
            d.get("scoring_func"),
            "DeepSeek-V3 routes by sigmoid scores plus a bias (topk_method noaux_tc)",
            "convert a DeepSeek-V3 checkpoint",
        )
    if not d.get("norm_topk_prob", True):
        fail("norm_topk_prob", False, "sigmoid top-k weights are normalised", "use True")
    experts, topk = int(d["n_routed_experts"]), int(d["num_experts_per_tok"])
    groups, group_topk = int(d.get("n_group", 1) or 1), int(d.get("topk_group", 1) or 1)
    grouped = groups > 1 and group_topk < groups
    if grouped and topk != 2 * group_topk:
        fail(
            "topk_group",
            group_topk,
            f"DeepSeek scores a group by its top 2 experts, Megatron by its top "
            f"num_experts_per_tok / topk_group = {topk}/{group_topk}",
            f"use topk_group={topk // 2} (DeepSeek-V3: 8 experts, 4 groups)",
        )
    shared = int(d.get("n_shared_experts", 0) or 0) * int(d["moe_intermediate_size"])
    return {
        "num_moe_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": int(d["moe_intermediate_size"]),
        "moe_shared_expert_intermediate_size": shared or None,
        "moe_layer_freq": [0] * k + [1] * (layers - k),
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_topk_scaling_factor": float(d.get("routed_scaling_factor", 1.0)),
        "moe_router_num_groups": groups if grouped else None,
        "moe_router_group_topk": group_topk if grouped else None,
        "moe_router_dtype": "fp32",  # HF's router runs in fp32
        "moe_router_load_balancing_type": "none",  # the bias balances; no aux loss in HF
        "moe_aux_loss_coeff": 0.0,
    }


def deepseek_fields_from_hf(d: dict[str, Any]) -> dict[str, Any]:
    """TransformerConfig keyword arguments of a DeepSeek-V3 config dict (attention, RoPE,
    MoE; the shared fields come from `config_from_hf`)."""
    if not d.get("rope_interleave", True):
        fail("rope_interleave", False, "our MLA rotates interleaved pairs", "use True")
    eps = float(d.get("rms_norm_eps", 1e-6))
    if eps != LATENT_NORM_EPS:
        fail(
            "rms_norm_eps",
            eps,
            "transformers' latent norms (q_a_layernorm, kv_a_layernorm) use 1e-6 whatever "
            "the config, ours the config's eps",
            "use rms_norm_eps=1e-6 (DeepSeek-V3's)",
        )
    if d.get("attention_bias"):
        fail("attention_bias", True, "MLA has no biases here", "use attention_bias=False")
    heads = d["num_attention_heads"]
    return {
        "multi_latent_attention": True,
        "qk_layernorm": True,
        "q_lora_rank": d.get("q_lora_rank"),
        "kv_lora_rank": int(d["kv_lora_rank"]),
        "qk_head_dim": int(d["qk_nope_head_dim"]),
        "qk_pos_emb_head_dim": int(d["qk_rope_head_dim"]),
        "v_head_dim": int(d["v_head_dim"]),
        "num_query_groups": heads,
        "kv_channels": int(d["qk_nope_head_dim"]) + int(d["qk_rope_head_dim"]),
        "ffn_hidden_size": int(d["intermediate_size"]),
        "add_bias_linear": False,
        "add_qkv_bias": False,
        **_rope_fields(d),
        **_moe_fields(d),
    }


def check_deepseek_representable(config: TransformerConfig) -> None:
    """Refuse what DeepseekV3ForCausalLM cannot express (it would change the logits)."""
    rules: list[tuple[str, Any, Any]] = [
        ("qk_layernorm", config.qk_layernorm, True),
        ("layernorm_epsilon", config.layernorm_epsilon, LATENT_NORM_EPS),
        ("add_bias_linear", config.add_bias_linear, False),
        ("rope_scaling", config.rope_scaling, None),
    ]
    if config.is_moe:
        k = config.moe_layer_pattern().index(True)
        rules += [
            (
                "moe_layer_pattern()",
                config.moe_layer_pattern()[k:],
                [True] * (config.num_layers - k),
            ),
            ("moe_router_score_function", config.moe_router_score_function, "sigmoid"),
            ("moe_router_enable_expert_bias", config.moe_router_enable_expert_bias, True),
            ("moe_shared_expert_gate", config.moe_shared_expert_gate, False),
        ]
        shared = config.moe_shared_expert_intermediate_size or 0
        if shared % config.moe_ffn_size:
            rules.append(
                ("moe_shared_expert_intermediate_size", shared, "a multiple of the expert size")
            )
        group_topk = config.moe_router_group_topk
        if group_topk and config.moe_router_topk != 2 * group_topk:
            rules.append(("moe_router_group_topk", group_topk, config.moe_router_topk // 2))
    for name, value, want in rules:
        if value != want:
            raise HFConfigError(
                f"TransformerConfig {name}={value!r}: DeepseekV3ForCausalLM needs {name}="
                f"{want!r}; fix: only models DeepSeek-V3's form can express export to it"
            )


def deepseek_to_hf_fields(config: TransformerConfig) -> dict[str, Any]:
    """The DeepSeek-V3 fields of the HF config dict of `config` (an MLA config)."""
    check_deepseek_representable(config)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rotary_base}
    if config.rotary_scaling_factor != 1.0:
        rope = {
            "rope_type": "yarn",
            "rope_theta": config.rotary_base,
            "factor": config.rotary_scaling_factor,
            "original_max_position_embeddings": config.yarn_original_max_position_embeddings,
            "beta_fast": config.yarn_beta_fast,
            "beta_slow": config.yarn_beta_slow,
            "mscale": config.mscale,
            "mscale_all_dim": config.mscale_all_dim,
        }
    out: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_key_value_heads": config.num_attention_heads,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_head_dim,
        "qk_rope_head_dim": config.qk_pos_emb_head_dim,
        "v_head_dim": config.v_head_dim,
        "head_dim": config.qk_pos_emb_head_dim,  # transformers' RoPE reads it
        "rope_interleave": True,
        "attention_bias": False,
        "rope_parameters": rope,
        "num_nextn_predict_layers": config.mtp_num_layers or 0,
        "first_k_dense_replace": config.num_layers,
        "n_routed_experts": 1,
        "num_experts_per_tok": 1,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 0,
        "moe_intermediate_size": config.ffn_hidden_size,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
    }
    if config.is_moe:
        assert config.num_moe_experts is not None, "is_moe: num_moe_experts is set"
        out.update(
            first_k_dense_replace=config.moe_layer_pattern().index(True),
            n_routed_experts=config.num_moe_experts,
            num_experts_per_tok=config.moe_router_topk,
            n_group=config.moe_router_num_groups or 1,
            topk_group=config.moe_router_group_topk or 1,
            n_shared_experts=(config.moe_shared_expert_intermediate_size or 0)
            // config.moe_ffn_size,
            moe_intermediate_size=config.moe_ffn_size,
            routed_scaling_factor=config.moe_router_topk_scaling_factor or 1.0,
        )
    return out


__all__ = [
    "HFConfigError",
    "check_deepseek_representable",
    "deepseek_fields_from_hf",
    "deepseek_to_hf_fields",
]
