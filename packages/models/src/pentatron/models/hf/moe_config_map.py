"""Hugging Face Mixtral / Qwen2-MoE configs <-> the MoE fields of `TransformerConfig`.

MixtralConfig                      TransformerConfig
num_local_experts                  num_moe_experts
num_experts_per_tok                moe_router_topk
(softmax, top-k, renormalise)      moe_router_pre_softmax=False (softmax over the top-k)
intermediate_size                  moe_ffn_hidden_size (= ffn_hidden_size), every layer MoE
router_aux_loss_coef               moe_aux_loss_coeff (HF scales its loss differently:
                                   a training setting, no effect on the logits)

Qwen2MoeConfig                     TransformerConfig
num_experts, num_experts_per_tok   num_moe_experts, moe_router_topk
norm_topk_prob=False / True        moe_router_pre_softmax=True / False
moe_intermediate_size              moe_ffn_hidden_size
intermediate_size                  ffn_hidden_size (the dense layers)
shared_expert_intermediate_size    moe_shared_expert_intermediate_size, moe_shared_expert_gate
decoder_sparse_step, mlp_only_layers  moe_layer_freq (a 0/1 list: HF's layer i is MoE
                                   when (i + 1) % step == 0 and i not in mlp_only_layers)
qkv_bias (default True)            add_qkv_bias (add_bias_linear=False)
"""

from __future__ import annotations

from typing import Any

from ..config import TransformerConfig
from .errors import HFConfigError, fail

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe")
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def _qwen_pattern(d: dict[str, Any]) -> list[int]:
    step, dense = int(d.get("decoder_sparse_step", 1) or 1), set(d.get("mlp_only_layers") or [])
    return [int(i not in dense and (i + 1) % step == 0) for i in range(d["num_hidden_layers"])]


def moe_fields_from_hf(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    """TransformerConfig keyword arguments of the MoE (and bias) part of a config dict."""
    if model_type == "mixtral":
        if float(d.get("router_jitter_noise", 0.0) or 0.0) != 0.0:
            fail(
                "router_jitter_noise",
                d["router_jitter_noise"],
                "Mixtral jitters the experts' input as well as the router's; Megatron's "
                "moe_input_jitter_eps jitters the router's only",
                "use router_jitter_noise=0.0 (and moe_input_jitter_eps as an override)",
            )
        experts, topk = d.get("num_local_experts", 8), d.get("num_experts_per_tok", 2)
        kw = {
            "ffn_hidden_size": d["intermediate_size"],
            "moe_ffn_hidden_size": d["intermediate_size"],
            "moe_layer_freq": 1,
            "moe_router_pre_softmax": False,
            "add_qkv_bias": False,
        }
    else:
        if d.get("use_sliding_window"):
            fail("use_sliding_window", True, "sliding-window attention is not supported", "False")
        experts, topk = d.get("num_experts", 60), d.get("num_experts_per_tok", 4)
        shared = d.get("shared_expert_intermediate_size")
        if not shared:
            fail(
                "shared_expert_intermediate_size",
                shared,
                "Qwen2MoeForCausalLM always has a shared expert",
                "use a positive size",
            )
        kw = {
            "ffn_hidden_size": d["intermediate_size"],
            "moe_ffn_hidden_size": d["moe_intermediate_size"],
            "moe_layer_freq": _qwen_pattern(d),
            "moe_router_pre_softmax": not d.get("norm_topk_prob", False),
            "moe_shared_expert_intermediate_size": shared,
            "moe_shared_expert_gate": True,
            "add_qkv_bias": bool(d.get("qkv_bias", True)),
        }
    if not experts:
        fail(f"{model_type} experts", experts, "a MoE config needs experts", "convert it as dense")
    return {
        **kw,
        "num_moe_experts": int(experts),
        "moe_router_topk": int(topk),
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(d.get("router_aux_loss_coef", 0.0) or 0.0),
        "add_bias_linear": False,
    }


def check_moe_representable(config: TransformerConfig, arch: str) -> None:
    """Refuse MoE features neither Mixtral nor Qwen2-MoE has (they would change the logits)."""
    rules = [
        ("moe_router_score_function", config.moe_router_score_function, "softmax"),
        ("moe_router_topk_scaling_factor", config.moe_router_topk_scaling_factor, None),
        ("moe_router_group_topk", config.moe_router_group_topk, None),
        ("moe_router_enable_expert_bias", config.moe_router_enable_expert_bias, False),
        ("moe_expert_capacity_factor", config.moe_expert_capacity_factor, None),
        ("add_bias_linear", config.add_bias_linear, False),
    ]
    if config.moe_router_load_balancing_type == "sinkhorn":
        rules.append(("moe_router_load_balancing_type", "sinkhorn", "aux_loss"))
    if arch == "mixtral":
        rules += [
            ("moe_router_pre_softmax", config.moe_router_pre_softmax, False),
            ("add_qkv_bias", config.add_qkv_bias, False),
            ("moe_layer_pattern()", all(config.moe_layer_pattern()), True),
        ]
    else:
        rules.append(("moe_shared_expert_gate", config.moe_shared_expert_gate, True))
    for name, value, want in rules:
        if value != want:
            raise HFConfigError(
                f"TransformerConfig {name}={value!r}: {ARCHITECTURES[arch]} needs {name}="
                f"{want!r}; fix: only models Hugging Face's {arch} can express export to it"
            )


def moe_to_hf_fields(config: TransformerConfig, arch: str) -> dict[str, Any]:
    """The MoE (and bias) fields of the HF config dict of `config`."""
    check_moe_representable(config, arch)
    common = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "num_experts_per_tok": config.moe_router_topk,
        "router_aux_loss_coef": config.moe_aux_loss_coeff,
    }
    if arch == "mixtral":
        return {
            **common,
            "intermediate_size": config.moe_ffn_size,
            "num_local_experts": config.num_moe_experts,
            "sliding_window": None,
            "router_jitter_noise": 0.0,
        }
    pattern = config.moe_layer_pattern()
    return {
        **common,
        "intermediate_size": config.ffn_hidden_size,
        "moe_intermediate_size": config.moe_ffn_size,
        "shared_expert_intermediate_size": config.moe_shared_expert_intermediate_size,
        "num_experts": config.num_moe_experts,
        "norm_topk_prob": not config.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, moe in enumerate(pattern) if not moe],
        "qkv_bias": bool(config.add_qkv_bias),
        "use_sliding_window": False,
    }
