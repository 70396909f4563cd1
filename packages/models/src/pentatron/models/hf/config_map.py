"""Hugging Face Llama / Mixtral / Qwen2-MoE / DeepSeek-V3 / gpt-oss config <->
`TransformerConfig`, both ways, with clear refusals (the MoE fields: `moe_config_map`,
DeepSeek's: `deepseek_config_map`, gpt-oss's: `gpt_oss_map`; the table below is shared).

    LlamaConfig field                         TransformerConfig field
    num_hidden_layers                         num_layers
    hidden_size                               hidden_size
    num_attention_heads                       num_attention_heads
    num_key_value_heads (None: = heads)       num_query_groups
    head_dim (None: hidden / heads)           kv_channels
    intermediate_size                         ffn_hidden_size
    rms_norm_eps                              layernorm_epsilon (normalization="RMSNorm")
    hidden_act="silu"                         activation="swiglu"
    attention_bias == mlp_bias                add_bias_linear (add_qkv_bias=False)
    rope_theta                                rotary_base (position_embedding_type="rope")
    rope_scaling / rope_parameters "llama3"   rope_scaling=RopeScaling(...)
    tie_word_embeddings                       not untie_embeddings_and_output_weights
    attention_dropout                         attention_dropout (hidden_dropout=0.0)
    initializer_range                         init_method_std (scaled_output_init=False)
    vocab_size, max_position_embeddings       returned beside the config

transformers 5 keeps `rope_theta` and the scaling in `rope_parameters`; transformers 4 has
`rope_theta` and `rope_scaling` (whose type key was once `type`). Both are read. A config
may be a `PretrainedConfig` or the plain dict of a `config.json`, so a checkpoint directory
can be read without transformers installed.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..config import RopeScaling, TransformerConfig
from .deepseek_config_map import (
    check_deepseek_representable,
    deepseek_fields_from_hf,
    deepseek_to_hf_fields,
)
from .errors import HFConfigError, fail
from .gpt_oss_map import check_gpt_oss_representable, gpt_oss_fields_from_hf, gpt_oss_to_hf_fields
from .moe_config_map import MOE_MODEL_TYPES, moe_fields_from_hf, moe_to_hf_fields
from .moe_map import hf_arch

SUPPORTED_MODEL_TYPES = ("llama", *MOE_MODEL_TYPES, "deepseek_v3", "gpt_oss")
# their RoPE fields are read by their own maps (DeepSeek's YaRN is MLA's; gpt-oss's YaRN)
_OWN_ROPE = ("deepseek_v3", "gpt_oss")
SUPPORTED_ROPE_TYPES = ("default", "llama3")

# Fields copied verbatim into `extras`, so config_to_hf can give them back.
_EXTRA_FIELDS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "use_cache",
    "pretraining_tp",
    "output_router_logits",
    "max_window_layers",
)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


__all__ = ["HFConfigError", "config_from_hf", "config_to_hf", "config_to_hf_dict"]
_fail = fail


def _as_dict(hf_config: Any) -> dict[str, Any]:
    if isinstance(hf_config, dict):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        d = hf_config.to_dict()
        # to_dict() of transformers 5 already holds rope_parameters; older ones rope_scaling.
        for name in ("rope_parameters", "rope_scaling", "rope_theta", "head_dim"):
            if name not in d and getattr(hf_config, name, None) is not None:
                d[name] = getattr(hf_config, name)
        return d
    raise TypeError(
        f"config_from_hf takes a transformers PretrainedConfig or a config.json dict, "
        f"got {type(hf_config).__name__}"
    )


def _rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None, float]:
    """(rope_theta, llama3 scaling or None, partial_rotary_factor) of either layout."""
    params = d.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params, field = d.get("rope_scaling"), "rope_scaling"
    params = dict(params or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        _fail(
            field, params, "per-layer-type RoPE parameters are not supported", "use a Llama config"
        )
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        _fail(
            f"{field}.rope_type",
            rope_type,
            f"only RoPE types {SUPPORTED_ROPE_TYPES} are supported (Megatron's RoPE has "
            "Llama-3 scaling only)",
            "convert a model trained with default or llama3 RoPE",
        )
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        _fail(
            "partial_rotary_factor",
            partial,
            "LlamaForCausalLM rotates the whole head",
            "use partial_rotary_factor=1.0",
        )
    if rope_type == "default":
        return float(theta), None, 1.0
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        _fail(f"{field}.{exc.args[0]}", None, "llama3 RoPE scaling needs this key", "add it")
    return float(theta), scaling, 1.0


def _params_dtype(d: dict[str, Any], params_dtype: torch.dtype | None) -> torch.dtype:
    if params_dtype is not None:
        return params_dtype
    name = d.get("dtype") or d.get("torch_dtype")
    if isinstance(name, torch.dtype):
        return name
    return _DTYPES.get(str(name).replace("torch.", ""), torch.float32)


def config_from_hf(
    hf_config: Any,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    params_dtype: torch.dtype | None = None,
    **overrides: Any,
) -> tuple[TransformerConfig, int, int, dict[str, Any]]:
    """`LlamaConfig` / `MixtralConfig` / `Qwen2MoeConfig` / `DeepseekV3Config` /
    `GptOssConfig` (or its config.json dict) ->
    `(config, vocab_size, max_seq_len, extras)`.

    The expert sizes apply to MoE configs only (a dense model with ep > 1 is refused).

    `extras` holds the HF fields that have no TransformerConfig counterpart (token ids,
    ...) for `config_to_hf`. `params_dtype` defaults to the checkpoint's `dtype` (fp32 when
    unset). `overrides` are further TransformerConfig fields (e.g. `sequence_parallel`,
    recompute settings, dropout for fine-tuning). Raises `HFConfigError` naming the HF field
    of any feature this GPT cannot represent.
    """
    d = _as_dict(hf_config)
    model_type = d.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        _fail(
            "model_type",
            model_type,
            f"only {SUPPORTED_MODEL_TYPES} are supported",
            "convert a Llama, Mixtral, Qwen2-MoE, DeepSeek-V3 or gpt-oss model",
        )
    act = d.get("hidden_act", "silu")
    if act != "silu" and model_type != "gpt_oss":  # gpt-oss's experts ignore hidden_act
        _fail(
            "hidden_act",
            act,
            "the gated MLP maps to SwiGLU, which needs silu",
            "use hidden_act='silu'",
        )
    if model_type == "llama":
        arch_kw = _llama_fields(d)
    elif model_type == "deepseek_v3":
        arch_kw = deepseek_fields_from_hf(d)
    elif model_type == "gpt_oss":
        arch_kw = gpt_oss_fields_from_hf(d)
    else:
        arch_kw = moe_fields_from_hf(d, model_type)
    if "num_moe_experts" in arch_kw:
        arch_kw["expert_model_parallel_size"] = expert_model_parallel_size
        arch_kw["expert_tensor_parallel_size"] = expert_tensor_parallel_size
    elif expert_model_parallel_size != 1:
        _fail(
            "model_type",
            model_type,
            f"expert_model_parallel_size={expert_model_parallel_size} needs a MoE model",
            "use ep=1 for a dense model",
        )
    if model_type not in ("qwen2_moe", "gpt_oss") and d.get("sliding_window") is not None:
        _fail(
            "sliding_window",
            d["sliding_window"],
            "sliding-window attention is not supported",
            "use None",
        )
    heads = d["num_attention_heads"]
    # DeepSeek's and gpt-oss's RoPE fields are in arch_kw; the others take Llama's RoPE
    theta, scaling, partial = (10000.0, None, 1.0) if model_type in _OWN_ROPE else _rope(d)
    fields: dict[str, Any] = dict(
        num_layers=d["num_hidden_layers"],
        hidden_size=d["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=d.get("num_key_value_heads") or heads,
        kv_channels=d.get("head_dim") or d["hidden_size"] // heads,
        normalization="RMSNorm",
        layernorm_epsilon=float(d.get("rms_norm_eps", 1e-6)),
        activation="swiglu",
        qk_layernorm=False,
        position_embedding_type="rope",
        rotary_base=theta,
        rotary_percent=partial,
        rope_scaling=scaling,
        init_method_std=float(d.get("initializer_range", 0.02)),
        scaled_output_init=False,
        attention_dropout=float(d.get("attention_dropout", 0.0)),
        hidden_dropout=0.0,
        untie_embeddings_and_output_weights=not d.get("tie_word_embeddings", False),
        params_dtype=_params_dtype(d, params_dtype),
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
    )
    # An override may name a field set above (hidden_dropout for fine-tuning): it wins.
    config = TransformerConfig(**{**fields, **arch_kw, **overrides})
    extras = {k: d[k] for k in _EXTRA_FIELDS if k in d}
    return config, int(d["vocab_size"]), int(d.get("max_position_embeddings", 2048)), extras


def _llama_fields(d: dict[str, Any]) -> dict[str, Any]:
    attn_bias, mlp_bias = bool(d.get("attention_bias", False)), bool(d.get("mlp_bias", False))
    if attn_bias != mlp_bias:
        _fail(
            "attention_bias",
            attn_bias,
            f"with mlp_bias={mlp_bias}: Megatron's add_bias_linear puts biases on all four "
            "linears (q/k/v/o and gate/up/down) or none",
            "use attention_bias == mlp_bias",
        )
    return {
        "ffn_hidden_size": d["intermediate_size"],
        "add_bias_linear": attn_bias,
        "add_qkv_bias": False,
    }


# gpt-oss's variants: GptOssForCausalLM's form only (hf_arch "gpt_oss": quick-GeGLU)
_GPT_OSS_FIELDS = (
    ("glu_linear_offset", 0.0),
    ("activation_func_clamp_value", None),
    ("softmax_type", "vanilla"),
    ("window_size", None),
)


def _check_representable(config: TransformerConfig) -> None:
    if hf_arch(config) == "gpt_oss":
        check_gpt_oss_representable(config)
        return
    for name, want in _GPT_OSS_FIELDS:
        value = getattr(config, name)
        if value != want:
            raise HFConfigError(
                f"TransformerConfig {name}={value!r}: of the Hugging Face forms only gpt-oss's "
                "has it, and gpt-oss's MLP is quick-GeGLU; fix: activation='quick_geglu' "
                "(app: --quick-geglu) with gpt-oss's other settings, or drop it"
            )
    if config.multi_latent_attention:  # DeepSeek-V3's form
        check_deepseek_representable(config)
        for name, value, want in (
            ("normalization", config.normalization, "RMSNorm"),
            ("activation", config.activation, "swiglu"),
        ):
            if value != want:
                raise HFConfigError(
                    f"TransformerConfig {name}={value!r}: DeepseekV3ForCausalLM needs "
                    f"{name}={want!r}; fix: only models of its shape export to it"
                )
        return
    rules: tuple[tuple[str, Any, Any], ...] = (
        ("normalization", config.normalization, "RMSNorm"),
        ("activation", config.activation, "swiglu"),
        ("position_embedding_type", config.position_embedding_type, "rope"),
        ("rotary_percent", config.rotary_percent, 1.0),
        ("qk_layernorm", config.qk_layernorm, False),
        # multi-token prediction has a Hugging Face form in DeepSeek-V3's only
        ("mtp_num_layers", config.mtp_num_layers, None),
    )
    for name, value, want in rules:
        if value != want:
            raise HFConfigError(
                f"TransformerConfig {name}={value!r}: Llama / Mixtral / Qwen2-MoE need "
                f"{name}={want!r}; fix: only GPTs of those shapes export to Hugging Face"
            )
    if hf_arch(config) == "llama" and config.add_qkv_bias and not config.add_bias_linear:
        raise HFConfigError(
            "TransformerConfig add_qkv_bias=True with add_bias_linear=False: Llama has biases "
            "on all attention projections (attention_bias) or none; fix: use add_bias_linear"
        )


def config_to_hf_dict(
    config: TransformerConfig,
    vocab_size: int,
    max_seq_len: int,
    extras: dict[str, Any] | None = None,
    *,
    rope_parameters: bool = True,
) -> dict[str, Any]:
    """The config.json dict of the matching `LlamaConfig` / `MixtralConfig` /
    `Qwen2MoeConfig` / `DeepseekV3Config` / `GptOssConfig` (by `moe_map.hf_arch(config)`;
    no transformers needed).

    `rope_parameters=True` writes transformers 5's `rope_parameters`; False the older
    `rope_theta` + `rope_scaling` (which transformers 5 still reads).
    """
    _check_representable(config)
    rope: dict[str, Any] = {"rope_type": "default"}
    if config.rope_scaling is not None:
        sc = config.rope_scaling
        assert isinstance(sc, RopeScaling), "TransformerConfig.__post_init__ turns a dict into one"
        rope = {
            "rope_type": "llama3",
            "factor": sc.factor,
            "low_freq_factor": sc.low_freq_factor,
            "high_freq_factor": sc.high_freq_factor,
            "original_max_position_embeddings": sc.original_max_position_embeddings,
        }
    dtype = str(config.params_dtype).replace("torch.", "")
    d: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "max_position_embeddings": max_seq_len,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.kv_channels,
        "hidden_act": "silu",
        "rms_norm_eps": config.layernorm_epsilon,
        "attention_dropout": config.attention_dropout,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "initializer_range": config.init_method_std,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    arch = hf_arch(config)
    if arch == "llama":
        d["attention_bias"] = d["mlp_bias"] = bool(config.add_bias_linear)
    elif arch == "gpt_oss":
        d.update(gpt_oss_to_hf_fields(config, rope_parameters))
        d.update(extras or {})
        return d
    elif arch == "deepseek_v3":
        d.update(deepseek_to_hf_fields(config))
        if not rope_parameters:  # transformers 4's form of the same RoPE
            rope_fields = d.pop("rope_parameters")
            d["rope_theta"] = rope_fields.pop("rope_theta")
            d["rope_scaling"] = None if rope_fields["rope_type"] == "default" else rope_fields
        d.update(extras or {})
        return d
    else:
        d.update(moe_to_hf_fields(config, arch))
    if rope_parameters:
        d["rope_parameters"] = {**rope, "rope_theta": config.rotary_base}
    else:
        d["rope_theta"] = config.rotary_base
        d["rope_scaling"] = None if config.rope_scaling is None else rope
    d.update(extras or {})
    return d


def config_to_hf(
    config: TransformerConfig,
    vocab_size: int,
    max_seq_len: int,
    extras: dict[str, Any] | None = None,
) -> Any:
    """A transformers config (Llama, Mixtral, Qwen2-MoE, DeepSeek-V3, gpt-oss) equal to `config`
    (imports transformers)."""
    import transformers

    arch = hf_arch(config)
    name = {
        "llama": "LlamaConfig",
        "mixtral": "MixtralConfig",
        "qwen2_moe": "Qwen2MoeConfig",
        "deepseek_v3": "DeepseekV3Config",
        "gpt_oss": "GptOssConfig",
    }
    cls = getattr(transformers, name[arch])
    v5 = "rope_parameters" in inspect.signature(cls.__init__).parameters
    d = config_to_hf_dict(config, vocab_size, max_seq_len, extras, rope_parameters=v5)
    architectures = d.pop("architectures")
    for key in ("model_type", "dtype", "torch_dtype"):
        d.pop(key)
    hf = cls(**d)
    hf.architectures = architectures
    return hf
