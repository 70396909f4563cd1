"""Named model presets and Hugging Face `config.json` import, as pentatron-pretrain flags.

Each preset is (flag values, MoE fields of TransformerConfig). Flags the user passes on the
command line override the preset's (parallel layout, batch, recompute, ...).

- `gpt3-175b`: Brown et al. 2020 (96 layers, h 12288, 96 heads, s 2048, GeLU, LayerNorm,
  learned positions, biases, V 50257).
- `llama3-8b` / `llama3-70b` / `llama3-405b`: Meta's configs (RMSNorm, SwiGLU, GQA with 8
  groups, RoPE base 500000, V 128256, untied embeddings, s 8192).
- `mixtral-8x7b`: 32 layers, h 4096, GQA 8, 8 experts top-2, expert ffn 14336, V 32000.
- `deepseek-v3`: 61 layers, h 7168, 128 heads of multi-latent attention (q latent 1536,
  kv latent 512, q/k 128 + 64 RoPE dims, v 128, YaRN factor 40), 256 routed experts top-8
  (ffn 2048) in 4 of 8 groups with sigmoid scores and the expert bias, plus one shared
  expert, V 129280, first 3 layers dense (ffn 18432), one MTP depth: 671B parameters
  (37B activated) plus the MTP layer's 11.6B.
- `gpt-oss-20b` / `gpt-oss-120b`: OpenAI's configs (24 / 36 layers, h 2880, 64 heads of 64
  dims, GQA 8, learnable sinks, a 128-key window on every second layer from the first,
  32 / 128 experts top-4 of ffn 2880 with biases, quick-GeGLU with offset 1 and clamp 7,
  YaRN x32 over 4096 positions, V 201088, untied): 20.91B / 116.83B parameters, as
  published (the model card counts 3.61B / 5.13B active without the input embedding).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..hf.config import GPT_OSS_DESTS, YARN_FIELDS
from .plan import MemoryPlanError

_LLAMA = {
    "normalization": "RMSNorm",
    "swiglu": True,
    "add_bias_linear": False,
    "group_query_attention": True,
    "num_query_groups": 8,
    "position_embedding_type": "rope",
    "untie_embeddings_and_output_weights": True,
    "vocab_size": 128256,
    "seq_length": 8192,
    "rotary_base": 500000.0,
    "hidden_dropout": 0.0,  # Llama trains without dropout (Megatron's default is 0.1)
    "attention_dropout": 0.0,
}

PRESETS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "gpt3-175b": (
        {
            "num_layers": 96,
            "hidden_size": 12288,
            "num_attention_heads": 96,
            "ffn_hidden_size": 4 * 12288,
            "seq_length": 2048,
            "vocab_size": 50257,
            "normalization": "LayerNorm",
            "position_embedding_type": "learned_absolute",
            "swiglu": False,
            "add_bias_linear": True,
        },
        {},
    ),
    "llama3-8b": (
        {
            **_LLAMA,
            "num_layers": 32,
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "ffn_hidden_size": 14336,
        },
        {},
    ),
    "llama3-70b": (
        {
            **_LLAMA,
            "num_layers": 80,
            "hidden_size": 8192,
            "num_attention_heads": 64,
            "ffn_hidden_size": 28672,
        },
        {},
    ),
    "llama3-405b": (
        {
            **_LLAMA,
            "num_layers": 126,
            "hidden_size": 16384,
            "num_attention_heads": 128,
            "ffn_hidden_size": 53248,
        },
        {},
    ),
    "mixtral-8x7b": (
        {
            **_LLAMA,
            "num_layers": 32,
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "ffn_hidden_size": 14336,
            "vocab_size": 32000,
            "seq_length": 4096,
            "rotary_base": 1000000.0,
        },
        {"num_moe_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 14336},
    ),
    "deepseek-v3": (
        {
            **_LLAMA,
            "num_layers": 61,
            "hidden_size": 7168,
            "num_attention_heads": 128,
            "group_query_attention": False,
            "num_query_groups": None,
            "ffn_hidden_size": 18432,
            "vocab_size": 129280,
            "seq_length": 4096,
            "rotary_base": 10000.0,
            "norm_epsilon": 1e-6,
            **{
                "multi_latent_attention": True,
                "q_lora_rank": 1536,
                "kv_lora_rank": 512,
                "qk_head_dim": 128,
                "qk_pos_emb_head_dim": 64,
                "v_head_dim": 128,
                "qk_layernorm": True,
                "rotary_scaling_factor": 40.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "transformer_impl": "local",
            },
            "mtp_num_layers": 1,
        },
        {
            "num_moe_experts": 256,
            "moe_router_topk": 8,
            "moe_ffn_hidden_size": 2048,
            "moe_shared_expert_intermediate_size": 2048,
            "moe_layer_freq": [0, 0, 0] + [1] * 58,
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": 8,
            "moe_router_group_topk": 4,
            "moe_router_topk_scaling_factor": 2.5,
        },
    ),
}


def _gpt_oss(layers: int, experts: int) -> tuple[dict[str, Any], dict[str, Any]]:
    flags = {
        **_LLAMA,
        "num_layers": layers,
        "hidden_size": 2880,
        "num_attention_heads": 64,
        "kv_channels": 64,
        "ffn_hidden_size": 2880,
        "vocab_size": 201088,
        "seq_length": 4096,
        "norm_epsilon": 1e-5,
        "swiglu": False,
        "quick_geglu": True,
        "glu_linear_offset": 1.0,
        "activation_func_clamp_value": 7.0,
        "add_bias_linear": True,
        "softmax_type": "learnable",
        "window_size": (127, 0),
        "window_attn_skip_freq": 2,
        "position_embedding_type": "yarn",
        "rotary_base": 150000.0,
        "rotary_scaling_factor": 32.0,
        "yarn_original_max_position_embeddings": 4096,
        "yarn_correction_range_round_to_int": False,
        "transformer_impl": "local",  # TE's attention takes neither sinks nor windows
    }
    moe = {
        "num_moe_experts": experts,
        "moe_router_topk": 4,
        "moe_ffn_hidden_size": 2880,
        "moe_layer_freq": 1,
    }
    return flags, moe


PRESETS["gpt-oss-20b"] = _gpt_oss(24, 32)
PRESETS["gpt-oss-120b"] = _gpt_oss(36, 128)


def preset(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    if name not in PRESETS:
        raise MemoryPlanError(
            f"--preset={name}: unknown preset; the rule: one of {sorted(PRESETS)}; "
            "fix: pick one, or pass the model flags / --hf-config"
        )
    flags, moe = PRESETS[name]
    return dict(flags), dict(moe)


HF_MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
)


def _fail(path: str, key: str, value: Any, rule: str, fix: str) -> MemoryPlanError:
    return MemoryPlanError(f"--hf-config={path}: {key}={value!r}: the rule: {rule}; fix: {fix}")


def from_hf_config(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Llama / Mistral / Mixtral / Qwen2 / Qwen2-MoE / DeepSeek-V2/V3 / gpt-oss `config.json` ->
    (flags, MoE fields). The sequence length is `max_position_embeddings` (the command
    line's --seq-length wins); MoE is read from the experts' keys, never left dense."""
    try:
        cfg = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MemoryPlanError(f"--hf-config={path}: cannot read a JSON config ({exc})") from None
    need = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise MemoryPlanError(
            f"--hf-config={path}: missing {missing}; the rule: a decoder-only HF config; "
            "fix: pass the model's config.json"
        )
    model_type = cfg.get("model_type", "llama")
    if model_type not in HF_MODEL_TYPES:
        raise _fail(
            path,
            "model_type",
            model_type,
            f"the calculator reads {list(HF_MODEL_TYPES)}",
            "pass the model as flags (--num-layers, --hidden-size, ...) instead",
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise _fail(
            path,
            "hidden_act",
            cfg["hidden_act"],
            "these models' gated MLP is sized as SwiGLU, which needs silu",
            "use a silu model, or pass the model as flags",
        )
    return _hf_flags(path, cfg, model_type), _hf_moe(cfg)


def _hf_flags(path: str, cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}  # transformers 5 keeps rope_theta there
    flags = {
        "num_layers": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "num_attention_heads": heads,
        "group_query_attention": True,
        "num_query_groups": cfg.get("num_key_value_heads") or heads,
        "kv_channels": cfg.get("head_dim"),
        "ffn_hidden_size": cfg.get("intermediate_size"),
        "vocab_size": cfg["vocab_size"],
        "normalization": "RMSNorm",
        "swiglu": True,
        "position_embedding_type": "rope",
        "rotary_base": float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        "untie_embeddings_and_output_weights": not cfg.get("tie_word_embeddings", False),
        # HF decoders name no hidden dropout; attention dropout is 0.0 in every released one
        "hidden_dropout": 0.0,
        "attention_dropout": float(cfg.get("attention_dropout", 0.0)),
        **_hf_biases(path, cfg, model_type),
    }
    if cfg.get("max_position_embeddings"):
        flags["seq_length"] = int(cfg["max_position_embeddings"])
        flags["max_position_embeddings"] = flags["seq_length"]
    if model_type.startswith("deepseek"):
        flags.update(_hf_mla(cfg, heads))
    if model_type == "gpt_oss":
        flags.update(_hf_gpt_oss(path, cfg))
    return flags


# gpt-oss's TransformerConfig fields that are flags of the same name
_GPT_OSS_FLAGS = (
    "num_query_groups",
    "kv_channels",
    *GPT_OSS_DESTS,
    "position_embedding_type",
    "rotary_base",
    *YARN_FIELDS,
)


def _hf_gpt_oss(path: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's activation, attention variants and RoPE, read as the Hugging Face
    conversion reads them (pentatron.models.hf's gpt-oss map)."""
    from pentatron.models.hf import HFConfigError
    from pentatron.models.hf.gpt_oss_map import gpt_oss_fields_from_hf

    try:
        fields = gpt_oss_fields_from_hf(cfg)
    except HFConfigError as exc:
        raise MemoryPlanError(f"--hf-config={path}: {exc}") from None
    out = {k: fields[k] for k in _GPT_OSS_FLAGS if k in fields}
    out.update(
        swiglu=False,
        quick_geglu=True,
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-5)),
        transformer_impl="local",  # TE's attention takes neither sinks nor windows
    )
    return out


def _hf_mla(cfg: dict[str, Any], heads: int) -> dict[str, Any]:
    """DeepSeek's multi-latent attention (HF's defaults where a key is absent: DeepSeek-V3's)
    and its MTP depths (`num_nextn_predict_layers`)."""
    rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    out: dict[str, Any] = {
        "group_query_attention": False,
        "num_query_groups": heads,
        "kv_channels": None,
        "multi_latent_attention": True,
        "q_lora_rank": cfg.get("q_lora_rank", 1536),
        "kv_lora_rank": cfg.get("kv_lora_rank", 512),
        "qk_head_dim": cfg.get("qk_nope_head_dim", 128),
        "qk_pos_emb_head_dim": cfg.get("qk_rope_head_dim", 64),
        "v_head_dim": cfg.get("v_head_dim", 128),
        "qk_layernorm": True,
        "transformer_impl": "local",
        "norm_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
    }
    if rope.get("rope_type", rope.get("type")) == "yarn":
        out["rotary_scaling_factor"] = float(rope.get("factor", 1.0))
        out["mscale"] = float(rope.get("mscale", 1.0))
        out["mscale_all_dim"] = float(rope.get("mscale_all_dim", 0.0))
    if cfg.get("num_nextn_predict_layers"):
        out["mtp_num_layers"] = int(cfg["num_nextn_predict_layers"])
    return out


def _hf_biases(path: str, cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Qwen2 (and Qwen2-MoE) always have q, k, v biases and no others; Llama-style configs
    put `attention_bias` on q, k, v and o, and `mlp_bias` on the MLP."""
    if model_type in ("qwen2", "qwen2_moe"):
        return {"add_bias_linear": False, "add_qkv_bias": True}
    if model_type == "gpt_oss":  # attention, router and experts all carry biases
        return {"add_bias_linear": True, "add_qkv_bias": False}
    attn, mlp = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))
    if attn != mlp:
        raise _fail(
            path,
            "attention_bias",
            attn,
            f"with mlp_bias={mlp}: --disable-bias-linear puts biases on all four linears or "
            "none (Megatron's add_bias_linear)",
            "use attention_bias == mlp_bias, or pass the model as flags",
        )
    return {"add_bias_linear": attn, "add_qkv_bias": False}


def _hf_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    """MoE fields from whichever experts' keys the config has:
    - DeepSeek: `n_routed_experts`, `moe_intermediate_size`, `n_shared_experts` shared
      experts of that width, dense until `first_k_dense_replace`, then every
      `moe_layer_freq`-th layer;
    - Mixtral: `num_local_experts` of width `intermediate_size`, every layer;
    - Qwen2-MoE: `num_experts` of width `moe_intermediate_size`, a gated shared expert of
      `shared_expert_intermediate_size`, layers by `decoder_sparse_step` / `mlp_only_layers`.
    """
    n = cfg["num_hidden_layers"]
    topk = cfg.get("num_experts_per_tok", 2)
    if cfg.get("n_routed_experts"):
        k, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1) or 1
        width = cfg["moe_intermediate_size"]
        return {
            "num_moe_experts": cfg["n_routed_experts"],
            "moe_router_topk": topk,
            "moe_ffn_hidden_size": width,
            "moe_shared_expert_intermediate_size": (cfg.get("n_shared_experts") or 0) * width
            or None,
            "moe_layer_freq": [int(i >= k and i % freq == 0) for i in range(n)],
        }
    if cfg.get("num_local_experts"):
        return {
            "num_moe_experts": cfg["num_local_experts"],
            "moe_router_topk": topk,
            "moe_ffn_hidden_size": cfg["intermediate_size"],
        }
    if cfg.get("num_experts"):
        step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or [])
        shared = cfg.get("shared_expert_intermediate_size") or None
        moe = {
            "num_moe_experts": cfg["num_experts"],
            "moe_router_topk": topk,
            "moe_ffn_hidden_size": cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
            "moe_shared_expert_intermediate_size": shared,
            "moe_layer_freq": [int(i not in dense and (i + 1) % step == 0) for i in range(n)],
        }
        if shared:
            moe["moe_shared_expert_gate"] = True  # Qwen2-MoE's sigmoid gate [1, h]
        return moe
    return {}
