"""--pretrained-checkpoint's model flags: what a Hugging Face `config.json` (or a checkpoint
of this app) says the model is, checked against the flags before any collective.

    implied_flags(dir)        {flag dest: value} the checkpoint's config implies
    resolve_pretrained(args)  which kind of checkpoint; with --use-checkpoint-args the model
                              flags not given (command line or --config) take those values
    check_against_hf(args)    a model flag that contradicts config.json fails, naming the
                              flag, both values and the fix

A Hugging Face config maps through `pentatron.models.hf.config_from_hf` (Llama, Mistral as
Llama, Qwen2 as Llama with q/k/v biases, Mixtral, Qwen2-MoE, DeepSeek-V3, gpt-oss, whose
MXFP4 experts are dequantised as they are read); a field it cannot represent fails there,
named. Only the architecture is compared: dropout, precision, the layout and
the sequence length are this run's choice.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ..arguments_validate import ArgumentError
from ..checkpointing import layout

HF_CONFIG = "config.json"

# TransformerConfig field -> the flag(s) that set it, for the contradiction message.
FIELD_FLAGS = {
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups (with --group-query-attention)",
    "kv_channels": "--kv-channels",
    "ffn_hidden_size": "--ffn-hidden-size",
    "normalization": "--normalization",
    "layernorm_epsilon": "--norm-epsilon",
    "activation": "--swiglu / --quick-geglu",
    "glu_linear_offset": "--glu-linear-offset",
    "activation_func_clamp_value": "--activation-func-clamp-value",
    "softmax_type": "--softmax-type",
    "window_size": "--window-size",
    "window_attn_skip_freq": "--window-attn-skip-freq",
    "add_bias_linear": "--disable-bias-linear",
    "add_qkv_bias": "--add-qkv-bias",
    "qk_layernorm": "--qk-layernorm",
    "position_embedding_type": "--position-embedding-type",
    "rotary_base": "--rotary-base",
    "rotary_percent": "--rotary-percent",
    "rope_scaling": "--use-rope-scaling / --rope-scaling-factor",
    "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "num_moe_experts": "--num-experts",
    "moe_router_topk": "--moe-router-topk",
    "moe_ffn_size": "--moe-ffn-hidden-size",
    "moe_layer_freq": "--moe-layer-freq",
    "moe_router_pre_softmax": "--moe-router-pre-softmax",
    "moe_router_score_function": "--moe-router-score-function",
    "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
    "moe_shared_expert_gate": "--moe-shared-expert-gate",
    "moe_router_enable_expert_bias": "--moe-router-enable-expert-bias",
    "moe_router_topk_scaling_factor": "--moe-router-topk-scaling-factor",
    "moe_router_num_groups": "--moe-router-num-groups",
    "moe_router_group_topk": "--moe-router-group-topk",
}
# DeepSeek-V3's multi-latent attention and its YaRN: field -> flag dest (the flag is its
# dashed form); compared and implied only where either side has MLA (the YaRN fields also
# where either side has --position-embedding-type yarn).
MLA_DESTS = {
    "multi_latent_attention": "multi_latent_attention",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_head_dim": "qk_head_dim",
    "qk_pos_emb_head_dim": "qk_pos_emb_head_dim",
    "v_head_dim": "v_head_dim",
    "rotary_scaling_factor": "rotary_scaling_factor",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
    "yarn_original_max_position_embeddings": "yarn_original_max_position_embeddings",
    "yarn_beta_fast": "yarn_beta_fast",
    "yarn_beta_slow": "yarn_beta_slow",
    "yarn_correction_range_round_to_int": "yarn_correction_range_round_to_int",
}
FIELD_FLAGS.update({f: "--" + d.replace("_", "-") for f, d in MLA_DESTS.items()})
# YaRN's fields, also read by standard attention with --position-embedding-type yarn (gpt-oss)
YARN_FIELDS = (
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_correction_range_round_to_int",
)
# gpt-oss's activation and attention variants: field -> flag dest (compared for every model)
GPT_OSS_DESTS = {
    "glu_linear_offset": "glu_linear_offset",
    "activation_func_clamp_value": "activation_func_clamp_value",
    "softmax_type": "softmax_type",
    "window_size": "window_size",
    "window_attn_skip_freq": "window_attn_skip_freq",
}
_MOE_FIELDS = {k for k in FIELD_FLAGS if k.startswith("moe_")}

# The model flags a checkpoint of this app carries in its saved args (--use-checkpoint-args).
ARCH_DESTS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "group_query_attention",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "max_position_embeddings",
    "normalization",
    "norm_epsilon",
    "swiglu",
    "quick_geglu",
    *GPT_OSS_DESTS.values(),
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "use_rope_scaling",
    "rope_scaling_factor",
    "apply_layernorm_1p",
    "untie_embeddings_and_output_weights",
    "make_vocab_size_divisible_by",
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_layer_freq",
    "moe_router_pre_softmax",
    "moe_router_score_function",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_router_enable_expert_bias",
    "moe_router_topk_scaling_factor",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_dtype",
    *MLA_DESTS.values(),
    "mtp_num_layers",
)


class PretrainedConfigError(ArgumentError):
    """--pretrained-checkpoint and the model flags disagree, or its config is unusable."""


def kind(path: str) -> str:
    """ "hf" (config.json + safetensors) or "pentatron" (this app's checkpoint folder)."""
    if layout.read_latest_iteration(path) is not None:
        return "pentatron"
    if os.path.isfile(os.path.join(path, HF_CONFIG)):
        return "hf"
    raise PretrainedConfigError(
        f"--pretrained-checkpoint {path}: neither a Hugging Face directory (config.json + "
        f"*.safetensors) nor a checkpoint of this app ({layout.TRACKER}); fix: pass the "
        "directory that holds one of them"
    )


def hf_config(path: str) -> tuple[Any, int, int, dict[str, Any]]:
    """`config_from_hf` of `path/config.json`: (TransformerConfig, vocab, max positions,
    extras); a field the GPT cannot represent fails naming it."""
    from pentatron.models.hf import HFConfigError, config_from_hf

    with open(os.path.join(path, HF_CONFIG)) as f:
        d = json.load(f)
    try:
        return config_from_hf(d)
    except HFConfigError as e:
        raise PretrainedConfigError(f"--pretrained-checkpoint {path}: {e}") from None


def implied_flags(path: str) -> dict[str, Any]:
    """{flag dest: value} of the model `path/config.json` describes."""
    config, _, max_positions, _ = hf_config(path)
    scaling = config.rope_scaling
    if scaling is not None and (
        scaling.low_freq_factor,
        scaling.high_freq_factor,
        scaling.original_max_position_embeddings,
    ) != (1.0, 4.0, 8192):
        raise PretrainedConfigError(
            f"--pretrained-checkpoint {path}: rope_scaling {scaling} differs from what "
            "--use-rope-scaling applies (low/high freq factors 1 and 4, original length 8192); "
            "fix: a checkpoint with Llama 3.1's RoPE scaling, or none"
        )
    out: dict[str, Any] = {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "group_query_attention": config.num_query_groups != config.num_attention_heads,
        "num_query_groups": config.num_query_groups,
        "kv_channels": config.kv_channels,
        "ffn_hidden_size": config.ffn_hidden_size,
        "max_position_embeddings": max_positions,
        "normalization": config.normalization,
        "norm_epsilon": config.layernorm_epsilon,
        "swiglu": config.activation == "swiglu",
        "quick_geglu": config.activation == "quick_geglu",
        "add_bias_linear": config.add_bias_linear,
        "add_qkv_bias": config.add_qkv_bias,
        "qk_layernorm": config.qk_layernorm,
        "position_embedding_type": config.position_embedding_type,
        "rotary_base": config.rotary_base,
        "rotary_percent": config.rotary_percent,
        "use_rope_scaling": scaling is not None,
        "untie_embeddings_and_output_weights": config.untie_embeddings_and_output_weights,
    }
    if scaling is not None:
        out["rope_scaling_factor"] = scaling.factor
    out.update({dest: getattr(config, f) for f, dest in GPT_OSS_DESTS.items()})
    if config.position_embedding_type == "yarn":
        out.update({MLA_DESTS[f]: getattr(config, f) for f in YARN_FIELDS})
    if config.is_moe:
        out.update(
            num_experts=config.num_moe_experts,
            moe_router_topk=config.moe_router_topk,
            moe_ffn_hidden_size=config.moe_ffn_hidden_size,
            moe_layer_freq=config.moe_layer_freq,
            moe_router_pre_softmax=config.moe_router_pre_softmax,
            moe_router_score_function=config.moe_router_score_function,
            moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=config.moe_shared_expert_gate,
            moe_router_enable_expert_bias=config.moe_router_enable_expert_bias,
            moe_router_topk_scaling_factor=config.moe_router_topk_scaling_factor,
            moe_router_num_groups=config.moe_router_num_groups,
            moe_router_group_topk=config.moe_router_group_topk,
            moe_router_dtype=config.moe_router_dtype,
        )
    if config.multi_latent_attention:
        out.update({dest: getattr(config, f) for f, dest in MLA_DESTS.items()})
    mtp = _mtp_layers_held(path, config.num_layers)
    if mtp:
        out["mtp_num_layers"] = mtp
    return out


def _mtp_layers_held(path: str, num_layers: int) -> int:
    """MTP depths whose tensors the checkpoint holds (DeepSeek's `model.layers.{L + k}.eh_proj`;
    transformers' save_pretrained drops them, DeepSeek's release has them)."""
    from pentatron.models.hf import SafetensorsDirSource

    with open(os.path.join(path, HF_CONFIG)) as f:
        wanted = int(json.load(f).get("num_nextn_predict_layers", 0) or 0)
    if not wanted:
        return 0
    with SafetensorsDirSource(path) as src:
        keys = src.keys()
    held = 0
    while held < wanted and f"model.layers.{num_layers + held}.eh_proj.weight" in keys:
        held += 1
    return held


def _saved_args(path: str) -> dict[str, Any]:
    """The model flags saved with the latest checkpoint of this app in `path`."""
    iteration = layout.read_latest_iteration(path)
    assert iteration is not None, "kind() said it is a checkpoint of this app"
    with open(os.path.join(layout.iter_dir(path, iteration), "common.json")) as f:
        saved = json.load(f).get("args", {})
    return {k: saved[k] for k in ARCH_DESTS if k in saved}


def resolve_pretrained(args: argparse.Namespace) -> None:
    """Before the flags are validated: `args.pretrained_kind` ("hf", "pentatron" or None)
    and, with --use-checkpoint-args, the model flags not given taken from the checkpoint.
    Reads files only (no collective)."""
    args.pretrained_kind = None
    if args.use_checkpoint_args and not args.pretrained_checkpoint:
        raise PretrainedConfigError(
            "--use-checkpoint-args: the rule: it takes the model flags from "
            "--pretrained-checkpoint; fix: pass --pretrained-checkpoint DIR, or drop it"
        )
    if not args.pretrained_checkpoint:
        return
    path = args.pretrained_checkpoint
    args.pretrained_kind = kind(path)
    given = set(getattr(args, "explicit_flags", ()))
    if args.pretrained_kind == "hf" and "make_vocab_size_divisible_by" not in given:
        # No padding beyond what tp needs (Megatron-Bridge's rule for imported models):
        # padded rows give logits of 0 that the softmax counts, so the loss would differ
        # from the model's own (and with tp). HF vocabularies divide common tp sizes.
        args.make_vocab_size_divisible_by = 1
    if not args.use_checkpoint_args:
        return
    values = implied_flags(path) if args.pretrained_kind == "hf" else _saved_args(path)
    for dest, value in values.items():
        if dest not in given:
            setattr(args, dest, value)


def _value(config: Any, field: str) -> Any:
    # an int frequency and its 0/1 list describe the same layers
    if field == "moe_layer_freq":
        return config.moe_layer_pattern()
    if field == "window_attn_skip_freq":
        layers = range(1, config.num_layers + 1)
        return [int(config.is_window_attention_layer(n)) for n in layers]
    if field == "window_size":  # (-1, 0) is no window; a list from JSON is the tuple
        w = config.window_size
        return None if w is None or w[0] < 0 else tuple(w)
    return getattr(config, field)


def check_against_hf(args: argparse.Namespace) -> None:
    """After validation: every architecture field the flags give equals config.json's."""
    if args.pretrained_kind != "hf":
        return
    from ..training.configs import transformer_config

    path = args.pretrained_checkpoint
    theirs, _, _, _ = hf_config(path)
    mine = transformer_config(args)
    for field, flag in FIELD_FLAGS.items():
        if field in _MOE_FIELDS and not (mine.is_moe or theirs.is_moe):
            continue
        mla = mine.multi_latent_attention or theirs.multi_latent_attention
        yarn = "yarn" in (mine.position_embedding_type, theirs.position_embedding_type)
        if field in YARN_FIELDS and not (mla or yarn):
            continue
        mla_shape = field in MLA_DESTS and field not in YARN_FIELDS
        if mla_shape and field != "multi_latent_attention" and not mla:
            continue
        a, b = _value(mine, field), _value(theirs, field)
        if a != b:
            raise PretrainedConfigError(
                f"{flag}: this run's model has {field}={a!r}, --pretrained-checkpoint {path} "
                f"has {field}={b!r}; fix: pass the checkpoint's value, or add "
                "--use-checkpoint-args to take every model flag you do not give from it"
            )
