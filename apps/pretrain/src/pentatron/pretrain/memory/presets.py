"""Named model presets and Hugging Face `config.json` import, as pentatron-pretrain flags.

Each preset is (flag values, MoE fields of TransformerConfig). Flags the user passes on the
command line override the preset's (parallel layout, batch, recompute, ...).

- `gpt3-175b`: Brown et al. 2020 (96 layers, h 12288, 96 heads, s 2048, GeLU, LayerNorm,
  learned positions, biases, V 50257).
- `llama3-8b` / `llama3-70b` / `llama3-405b`: Meta's configs (RMSNorm, SwiGLU, GQA with 8
  groups, RoPE base 500000, V 128256, untied embeddings, s 8192).
- `mixtral-8x7b`: 32 layers, h 4096, GQA 8, 8 experts top-2, expert ffn 14336, V 32000.
- `deepseek-v3`: 61 layers, h 7168, 128 heads, 256 routed experts top-8 (ffn 2048) plus one
  shared expert, V 129280, first 3 layers dense (ffn 18432). Its Multi-head Latent
  Attention is approximated as GQA with its dims: 128 heads of head dim 192 (128 nope +
  64 rope) and 128 query groups, i.e. MHA with kv_channels 192 (MLA's low-rank q/kv
  compression and its smaller KV activations are not modelled); multi-token prediction
  is left out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .plan import MemoryPlanError

_LLAMA = {
    "normalization": "RMSNorm",
    "swiglu": True,
    "disable_bias_linear": True,
    "group_query_attention": True,
    "num_query_groups": 8,
    "position_embedding_type": "rope",
    "untie_embeddings_and_output_weights": True,
    "vocab_size": 128256,
    "seq_length": 8192,
    "rotary_base": 500000.0,
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
            "disable_bias_linear": False,
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
            "num_query_groups": 128,
            "kv_channels": 192,
            "ffn_hidden_size": 18432,
            "vocab_size": 129280,
            "seq_length": 4096,
            "rotary_base": 10000.0,
        },
        {
            "num_moe_experts": 256,
            "moe_router_topk": 8,
            "moe_ffn_hidden_size": 2048,
            "moe_shared_expert_intermediate_size": 2048,
            "moe_layer_freq": [0, 0, 0] + [1] * 58,
        },
    ),
}


def preset(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    if name not in PRESETS:
        raise MemoryPlanError(
            f"--preset={name}: unknown preset; the rule: one of {sorted(PRESETS)}; "
            "fix: pick one, or pass the model flags / --hf-config"
        )
    flags, moe = PRESETS[name]
    return dict(flags), dict(moe)


def from_hf_config(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Llama / Mistral / Mixtral / Qwen2-style `config.json` -> (flags, MoE fields)."""
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
    heads = cfg["num_attention_heads"]
    flags = {
        "num_layers": cfg["num_hidden_layers"],
        "hidden_size": cfg["hidden_size"],
        "num_attention_heads": heads,
        "group_query_attention": True,
        "num_query_groups": cfg.get("num_key_value_heads") or heads,
        "kv_channels": cfg.get("head_dim"),
        "ffn_hidden_size": cfg.get("intermediate_size"),
        "vocab_size": cfg["vocab_size"],
        "seq_length": min(cfg.get("max_position_embeddings", 4096), 4096),
        "normalization": "RMSNorm",
        "swiglu": cfg.get("hidden_act", "silu") == "silu",
        "disable_bias_linear": not cfg.get("mlp_bias", False),
        "add_qkv_bias": bool(cfg.get("attention_bias", False)),
        "position_embedding_type": "rope",
        "rotary_base": float(cfg.get("rope_theta", 10000.0)),
        "untie_embeddings_and_output_weights": not cfg.get("tie_word_embeddings", False),
    }
    moe = {}
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        moe = {
            "num_moe_experts": experts,
            "moe_router_topk": cfg.get("num_experts_per_tok", 2),
            "moe_ffn_hidden_size": cfg.get("moe_intermediate_size") or flags["ffn_hidden_size"],
        }
    return flags, moe
