"""`TransformerConfig`: the shape and behaviour of a GPT, with Megatron-LM's field names.

Every field is validated in `__post_init__`, before any process group is touched: a bad
value raises `ModelConfigError` naming the field, the rule and a fix. The parallel sizes
(`tensor_model_parallel_size`, ...) must match the grid the model is built on; the layer
split over the pipeline is checked with `pentatron.pipeline.StageLayout`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pentatron.pipeline import PipelineConfigError, PipelineLayout, StageLayout

from .config_checks import (
    ModelConfigError,
    check_attention_variants,
    check_context_parallel,
    check_glu,
    check_mla,
    check_moe,
    check_mtp,
    check_recompute_modules,
    fail,
)
from .sdpa import ATTENTION_BACKENDS

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = ("gelu", "swiglu", "quick_geglu")
POSITION_EMBEDDINGS = ("learned_absolute", "rope", "yarn", "none")
ROTARY_EMBEDDINGS = ("rope", "yarn")  # yarn: RoPE with YaRN's frequencies (rope.py)
RECOMPUTE_GRANULARITIES = (None, "full", "selective")
RECOMPUTE_METHODS = (None, "uniform", "block")


_fail = fail


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x): the sigmoid approximation of GeLU (Megatron's quick_gelu)."""
    return x * torch.sigmoid(1.702 * x)


def _positive_int(name: str, value: Any, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        _fail(name, value, "must be a positive integer", f"set {name} >= 1")


def _choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        _fail(name, value, f"one of {allowed}", f"set {name} to one of {allowed}")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (Hugging Face `rope_type="llama3"`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            _fail("rope_scaling.factor", self.factor, "factor >= 1", "e.g. factor=8.0")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            _fail(
                "rope_scaling.low_freq_factor",
                self.low_freq_factor,
                "0 < low_freq_factor < high_freq_factor",
                "e.g. low_freq_factor=1.0, high_freq_factor=4.0",
            )
        _positive_int(
            "rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings
        )


@dataclass
class TransformerConfig:
    """Megatron-LM's TransformerConfig (the dense-GPT subset), validated on construction.

    `activation`: "gelu" (fc1 -> GeLU -> fc2), "swiglu" (fc1 holds [gate, up];
    silu(gate) * up -> fc2) or "quick_geglu" (gpt-oss: quick_gelu(gate) * up, Megatron's
    --quick-geglu); `gated_linear_unit` and `activation_func` give Megatron's view.
    `bias_activation_fusion` (Megatron's field; its training flags turn it on by default)
    runs SwiGLU as one autograd function that keeps only fc1's output for backward, `F`
    fewer elements per token and layer, with bitwise the same numbers (`activations.py`).
    GeLU is unchanged by it: autograd's GeLU already keeps only its input, and the exact
    (erf) GeLU is kept where Megatron's fused kernel switches to the tanh approximation.
    `apply_query_key_layer_scaling` is accepted for compatibility: with SDPA it changes no
    number (it only rescales inside a fused fp16 softmax in Megatron).
    `layernorm_zero_centered_gamma` (--apply-layernorm-1p): every norm's weight is stored
    zero-centred (initialised to 0) and applied as `1 + weight`, LayerNorm and RMSNorm
    (norm.py); the Hugging Face conversion adds / subtracts the 1.
    `attention_backend` (--attention-backend): the SDPA kernels core attention may use
    (sdpa.py; "fused" needs CUDA, `sdpa.attention_backend_needs_cuda`).
    `recompute_modules` (--recompute-modules): with `recompute_granularity="selective"`, the
    parts recomputed, Megatron's names: core_attn, mlp, layernorm, moe, moe_act,
    shared_experts (recompute.py); None becomes ["core_attn"].
    `moe_router_dtype` (--moe-router-dtype) and `moe_router_force_load_balancing`
    (--moe-router-force-load-balancing): see moe/router.py.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int | None = None  # None: = num_attention_heads (MHA)
    kv_channels: int | None = None  # None: hidden_size // num_attention_heads
    ffn_hidden_size: int | None = None  # None: 4 * hidden_size
    normalization: str = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    # Megatron's --apply-layernorm-1p: norm weights stored zero-centred, applied as 1 + w
    layernorm_zero_centered_gamma: bool = False
    activation: str = "gelu"
    bias_activation_fusion: bool = False
    # gated activations only (activations.py): act(clamp(gate, max=c)) * (clamp(up, -c, c)
    # + offset), Megatron's --activation-func-clamp-value and --glu-linear-offset (gpt-oss)
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    # attention variants (gpt-oss; attention.py, config_checks.check_attention_variants):
    # "off-by-one" / "learnable" add a per-head sink logit to the softmax's denominator
    softmax_type: str = "vanilla"
    # sliding window (left, right): query i sees keys i - left .. i (right must be 0)
    window_size: tuple[int, int] | None = None
    # None: every layer windowed; N: layer l (1-based) full when l % N == 0; or a 0/1 list
    window_attn_skip_freq: int | list[int] | None = None
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rope_scaling: RopeScaling | dict | None = None
    init_method_std: float = 0.02
    scaled_output_init: bool = True  # linear_proj / linear_fc2: std / sqrt(2 num_layers)
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    untie_embeddings_and_output_weights: bool = False
    sequence_parallel: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # with recompute_granularity="selective": which parts (None: ["core_attn"], Megatron's)
    recompute_modules: list[str] | None = None
    params_dtype: torch.dtype = torch.float32
    fp32_residual_connection: bool = False
    apply_query_key_layer_scaling: bool = False
    # SDPA kernels core attention may use: auto|flash|fused|unfused|local (see sdpa.py)
    attention_backend: str = "auto"
    calculate_per_token_loss: bool = False  # losses are sums over tokens (MoE aux losses follow)
    fp8: str | None = None  # "e4m3" | "hybrid": only with the transformer-engine spec
    # transformer-engine's DelayedScaling recipe (Megatron's names and defaults)
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"  # "most_recent" | "max"
    # weight grads of the parallel linears accumulate straight into `main_grad` (False: into
    # `.grad`, which the data-parallel wrapper then adds to main_grad: one extra buffer)
    gradient_accumulation_fusion: bool = True
    # CUDA graphs of the transformer layers (models.cuda_graphs); checked in _check_cuda_graph
    enable_cuda_graph: bool = False
    cuda_graph_warmup_steps: int = 3
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    # "loop": Megatron's round robin of virtual stages; "v": ZBV's V (two chunks per rank,
    # chunk 1 of rank r is stage 2p - 1 - r, so rank 0 holds the first and the last stage)
    pipeline_placement: str = "loop"
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    # Megatron's even split with the embedding / the loss counted as a layer of the first /
    # last virtual stage (so that stage builds one transformer layer fewer)
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    # Megatron's custom layout: what every virtual stage holds, as a string ("Et*3|(tt|)*29,
    # |mL") or a list of stages (pentatron.pipeline.custom_layout); vpp follows from it
    pipeline_model_parallel_layout: str | list[list[str]] | None = None
    # --- context parallelism (validated in config_checks.check_context_parallel) ---
    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"  # "p2p" (ring) | "all_gather" | "a2a" (Ulysses) | "a2a+p2p"
    # "a2a+p2p": [a2a size, p2p size], a2a over consecutive cp ranks (inside a node), the
    # ring over the rest; the grid's ParallelConfig.hierarchical_cp holds the same sizes
    hierarchical_context_parallel_sizes: list[int] | None = None
    # --- Mixture of Experts (validated in config_checks.check_moe); None: dense ---
    num_moe_experts: int | None = None
    moe_layer_freq: int | list[int] = 1  # every n-th layer is MoE, or a 0/1 list per layer
    moe_ffn_hidden_size: int | None = None  # None: ffn_hidden_size
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"  # "softmax" | "sigmoid"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss|seq_aux_loss|sinkhorn|none
    moe_router_dtype: str | None = None  # "fp32" | "fp64" | None (logits in the input dtype)
    moe_router_force_load_balancing: bool = False  # random logits (benchmarking only)
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_input_jitter_eps: float | None = None
    moe_expert_capacity_factor: float | None = None
    moe_token_drop_policy: str = "probs"  # "probs" | "position"
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_dispatcher_type: str = "allgather"  # "allgather" | "alltoall"
    moe_grouped_gemm: bool = False
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_overlap: bool = False
    moe_shared_expert_gate: bool = False  # sigmoid(x @ gate) scales the shared output (Qwen2-MoE)
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: tensor_model_parallel_size
    # --- multi-latent attention (DeepSeek-V2/V3; validated in config_checks.check_mla) ---
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # None: q projected from the hidden state directly
    kv_lora_rank: int = 32
    qk_head_dim: int = 128  # per-head q/k dims without RoPE
    qk_pos_emb_head_dim: int = 64  # per-head q/k dims with RoPE (k's shared by all heads)
    v_head_dim: int = 128
    # YaRN scaling of MLA's RoPE (Megatron's names; factor 1 = plain RoPE, MLA's default)
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_correction_range_round_to_int: bool = True
    # --- multi-token prediction (DeepSeek-V3; config_checks.check_mtp; see mtp.py) ---
    mtp_num_layers: int | None = None  # None: no MTP; else depths predicted past the next token
    mtp_loss_scaling_factor: float = 0.1  # the MTP loss weight (averaged over the depths)

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            _positive_int(name, getattr(self, name))
        for name in ("num_query_groups", "kv_channels", "ffn_hidden_size"):
            _positive_int(name, getattr(self, name), optional=True)
        self._fill_defaults()
        self._check_choices()
        self._check_attention()
        check_glu(self)
        check_attention_variants(self)
        self._check_tensor_parallel()
        self._check_rope()
        self._check_recompute()
        self._check_pipeline()
        check_context_parallel(self)
        check_moe(self)
        check_mla(self)
        check_mtp(self)
        self._check_cuda_graph()

    # --- defaults and simple checks ------------------------------------------------------------
    def _fill_defaults(self) -> None:
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                _fail(
                    "kv_channels",
                    None,
                    f"without kv_channels, hidden_size={self.hidden_size} must be divisible "
                    f"by num_attention_heads={self.num_attention_heads}",
                    "set kv_channels (the head dim) or change hidden_size",
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.recompute_modules is None:
            self.recompute_modules = ["core_attn"]  # Megatron's default

    def _check_choices(self) -> None:
        _choice("normalization", self.normalization, NORMALIZATIONS)
        _choice("activation", self.activation, ACTIVATIONS)
        _choice("position_embedding_type", self.position_embedding_type, POSITION_EMBEDDINGS)
        _choice("fp8", self.fp8, (None, "e4m3", "hybrid"))
        _choice("fp8_amax_compute_algo", self.fp8_amax_compute_algo, ("most_recent", "max"))
        _positive_int("fp8_amax_history_len", self.fp8_amax_history_len)
        if not isinstance(self.fp8_margin, int) or self.fp8_margin < 0:
            _fail("fp8_margin", self.fp8_margin, "must be an integer >= 0", "set fp8_margin=0")
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if (
            not isinstance(self.params_dtype, torch.dtype)
            or not self.params_dtype.is_floating_point
        ):
            _fail(
                "params_dtype", self.params_dtype, "a floating torch.dtype", "e.g. torch.bfloat16"
            )
        for name in ("attention_dropout", "hidden_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                _fail(name, p, "0 <= p < 1", f"e.g. {name}=0.0")
        if not self.layernorm_epsilon > 0:
            _fail("layernorm_epsilon", self.layernorm_epsilon, "> 0", "e.g. 1e-5")
        if not self.init_method_std > 0:
            _fail("init_method_std", self.init_method_std, "> 0", "e.g. 0.02")

    def _check_attention(self) -> None:
        heads, groups = self.num_attention_heads, self.num_query_groups
        assert groups is not None, "_fill_defaults sets num_query_groups"
        if heads % groups:
            _fail(
                "num_query_groups",
                groups,
                f"query groups must divide num_attention_heads={heads} (each group serves "
                "the same number of query heads)",
                f"use a divisor of {heads}, e.g. {heads} (MHA) or 1 (MQA)",
            )

    def _check_tensor_parallel(self) -> None:
        t = self.tensor_model_parallel_size
        _positive_int("tensor_model_parallel_size", t)
        assert self.num_query_groups is not None, "_fill_defaults sets num_query_groups"
        assert self.ffn_hidden_size is not None, "_fill_defaults sets ffn_hidden_size"
        rules = (
            ("num_attention_heads", self.num_attention_heads, "attention heads are split"),
            (
                "num_query_groups",
                self.num_query_groups,
                "query groups (k/v heads; Megatron does not replicate them) are split",
            ),
            ("ffn_hidden_size", self.ffn_hidden_size, "the MLP's hidden units are split"),
        )
        for name, value, what in rules:
            if value % t:
                _fail(
                    name,
                    value,
                    f"{what} evenly over tensor_model_parallel_size={t}, so {name} must be a "
                    "multiple of it",
                    f"use a tensor_model_parallel_size that divides {value}, or change {name}",
                )

    def _check_rope(self) -> None:
        if not 0.0 < self.rotary_percent <= 1.0:
            _fail("rotary_percent", self.rotary_percent, "0 < rotary_percent <= 1", "e.g. 1.0")
        if self.position_embedding_type in ROTARY_EMBEDDINGS:
            if self.rotary_dim % 2:
                _fail(
                    "rotary_percent",
                    self.rotary_percent,
                    f"kv_channels * rotary_percent = {self.rotary_dim} must be even "
                    "(rotate-half pairs dimensions)",
                    "choose rotary_percent so that the rotary dim is even",
                )
            if not self.rotary_base > 0:
                _fail("rotary_base", self.rotary_base, "> 0", "e.g. 10000")
        if self.position_embedding_type == "yarn":
            if not self.rotary_scaling_factor >= 1.0:
                _fail(
                    "rotary_scaling_factor",
                    self.rotary_scaling_factor,
                    ">= 1 with position_embedding_type='yarn' (1: plain RoPE)",
                    "e.g. rotary_scaling_factor=32 (gpt-oss)",
                )
            _positive_int(
                "yarn_original_max_position_embeddings", self.yarn_original_max_position_embeddings
            )
        if self.rope_scaling is not None and self.position_embedding_type != "rope":
            _fail(
                "rope_scaling",
                self.rope_scaling,
                "Llama 3's RoPE scaling needs position_embedding_type='rope' (not with YaRN)",
                "set position_embedding_type='rope' or rope_scaling=None",
            )

    def _check_recompute(self) -> None:
        _choice("recompute_granularity", self.recompute_granularity, RECOMPUTE_GRANULARITIES)
        _choice("recompute_method", self.recompute_method, RECOMPUTE_METHODS)
        gran, method, n = (
            self.recompute_granularity,
            self.recompute_method,
            self.recompute_num_layers,
        )
        if gran == "full":
            if method is None:
                _fail(
                    "recompute_method",
                    None,
                    "recompute_granularity='full' needs a method",
                    "set recompute_method='uniform' (groups of n layers) or 'block' (first n)",
                )
            _positive_int("recompute_num_layers", n)
            assert n is not None, "_positive_int raised on None"
            if n > self.num_layers:
                _fail(
                    "recompute_num_layers",
                    n,
                    f"at most num_layers={self.num_layers}",
                    f"set recompute_num_layers <= {self.num_layers}",
                )
        elif gran == "selective":
            if method is not None or n is not None:
                _fail(
                    "recompute_method",
                    method,
                    "selective recompute (recompute_modules) takes no method or layer count",
                    "leave recompute_method and recompute_num_layers unset",
                )
        elif method is not None or n is not None:
            _fail(
                "recompute_granularity",
                None,
                "recompute_method/recompute_num_layers need recompute_granularity='full'",
                "set recompute_granularity='full' or unset the method and layer count",
            )
        check_recompute_modules(self)
        if gran is not None and self.fp8 is not None:
            _fail(
                "recompute_granularity",
                gran,
                f"with fp8={self.fp8!r} the recomputed forward would update the FP8 scaling "
                "state a second time (that needs transformer-engine's FP8-aware checkpoint, "
                "not wired here)",
                "drop recomputation, or train in bf16 with it",
            )

    def _check_cuda_graph(self) -> None:
        """What a captured layer cannot hold: RNG draws (dropout), data-dependent shapes
        (MoE routing), Python-driven communication (context-parallel rings) and
        checkpointed recomputation."""
        if not self.enable_cuda_graph:
            return
        _positive_int("cuda_graph_warmup_steps", self.cuda_graph_warmup_steps)
        for name in ("hidden_dropout", "attention_dropout"):
            if getattr(self, name) > 0:
                _fail(
                    name,
                    getattr(self, name),
                    "enable_cuda_graph replays the layers without drawing new dropout masks",
                    f"set {name}=0 (the usual for LLM pretraining) or drop enable_cuda_graph",
                )
        refused = [
            ("num_moe_experts", self.is_moe, "MoE routing gives each step other shapes"),
            (
                "context_parallel_size",
                self.context_parallel_size > 1,
                "cp attention is driven from Python per block",
            ),
            (
                "recompute_granularity",
                self.recompute_granularity is not None,
                "recomputation re-enters the forward inside backward",
            ),
        ]
        for name, bad, why in refused:
            if bad:
                _fail(
                    name,
                    getattr(self, name),
                    f"enable_cuda_graph cannot capture it: {why}",
                    f"drop enable_cuda_graph or {name}",
                )

    def _check_pipeline(self) -> None:
        _positive_int("pipeline_model_parallel_size", self.pipeline_model_parallel_size)
        vpp = self.virtual_pipeline_model_parallel_size
        _positive_int("virtual_pipeline_model_parallel_size", vpp, optional=True)
        _choice("pipeline_placement", self.pipeline_placement, ("loop", "v"))
        if self.pipeline_placement == "v":
            refused = (
                (
                    "untie_embeddings_and_output_weights",
                    not self.untie_embeddings_and_output_weights,
                    "rank 0 would hold the embedding and its tied copy in two chunks",
                    "set untie_embeddings_and_output_weights=True",
                ),
                (
                    "mtp_num_layers",
                    self.mtp_num_layers,
                    "multi-token prediction shares the embedding across stages",
                    "set mtp_num_layers=None or use pipeline_placement='loop'",
                ),
            )
            for name, bad, why, fix in refused:
                if bad:
                    _fail(name, getattr(self, name), f"with pipeline_placement='v': {why}", fix)
        if self.pipeline_model_parallel_layout is not None:
            self._check_custom_layout()
        try:
            self.stage_layout()
        except PipelineConfigError as exc:
            raise ModelConfigError(
                f"num_layers={self.num_layers} does not fit the pipeline layout "
                f"(pipeline_model_parallel_size={self.pipeline_model_parallel_size}, "
                f"virtual_pipeline_model_parallel_size={vpp}): {exc}"
            ) from None

    def _check_custom_layout(self) -> None:
        """Megatron's rules for pipeline_model_parallel_layout; sets vpp from it (None for
        one stage per rank), as Megatron's TransformerConfig does."""
        others = {
            "num_layers_in_first_pipeline_stage": self.num_layers_in_first_pipeline_stage,
            "num_layers_in_last_pipeline_stage": self.num_layers_in_last_pipeline_stage,
            "account_for_embedding_in_pipeline_split": self.account_for_embedding_in_pipeline_split
            or None,
            "account_for_loss_in_pipeline_split": self.account_for_loss_in_pipeline_split or None,
        }
        for name, value in others.items():
            if value is not None:
                _fail(
                    name,
                    value,
                    "pipeline_model_parallel_layout already places every layer (Megatron-LM)",
                    f"drop {name} or pipeline_model_parallel_layout",
                )
        try:
            layout = self.custom_layout()
            assert layout is not None
            layout.check(self.num_layers, self.mtp_num_layers)
        except PipelineConfigError as exc:
            raise ModelConfigError(str(exc)) from None
        if layout.mtp_standalone and not self.untie_embeddings_and_output_weights:
            _fail(
                "pipeline_model_parallel_layout",
                self.pipeline_model_parallel_layout,
                "a standalone MTP stage (its m's before the loss's stage) with tied embeddings "
                "would hold a third copy of the embedding",
                "set untie_embeddings_and_output_weights=True (as DeepSeek-V3), or move the m's "
                "into the last stage",
            )
        detected = layout.vpp if layout.vpp > 1 else None
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp != detected:
            _fail(
                "virtual_pipeline_model_parallel_size",
                vpp,
                f"pipeline_model_parallel_layout has {layout.vpp} stage(s) per pipeline rank",
                f"set it to {detected} or leave it None",
            )
        self.virtual_pipeline_model_parallel_size = detected

    # --- derived values ----------------------------------------------------------------------
    def custom_layout(self) -> PipelineLayout | None:
        """pipeline_model_parallel_layout parsed (None without one)."""
        layout = self.pipeline_model_parallel_layout
        if layout is None:
            return None
        key = layout if isinstance(layout, str) else tuple(tuple(stage) for stage in layout)
        return _parse_layout(key, self.pipeline_model_parallel_size)

    @property
    def mtp_standalone(self) -> bool:
        """The MTP layers sit in a stage of their own before the loss's (a custom layout)."""
        layout = self.custom_layout()
        return layout is not None and layout.mtp_standalone

    def mtp_on(self, pp_rank: int, vp_stage: int | None, post_process: bool) -> bool:
        """Whether chunk `vp_stage` of pipeline rank `pp_rank` holds the MTP layers (and an
        embedding copy): the last stage (`post_process`), or a custom layout's MTP stage."""
        if not self.mtp_num_layers:
            return False
        layout = self.custom_layout()
        if layout is not None and layout.mtp_standalone:
            return self.stage_layout().stage(pp_rank, vp_stage or 0) == layout.mtp_stage()
        return post_process

    def final_norm_on(self, pp_rank: int, vp_stage: int | None, post_process: bool) -> bool:
        """Whether that chunk applies the decoder's final norm: the last stage, or a
        standalone MTP stage (whose first depth reads the normed output, as on one stage)."""
        if self.mtp_standalone:
            return self.mtp_on(pp_rank, vp_stage, post_process)
        return post_process

    def stage_layout(self) -> StageLayout:
        """Which layers each (pipeline rank, virtual stage) builds (see pentatron.pipeline)."""
        custom = self.custom_layout()
        return StageLayout(
            num_layers=self.num_layers,
            pp=self.pipeline_model_parallel_size,
            vpp=self.virtual_pipeline_model_parallel_size,
            first_stage_layers=self.num_layers_in_first_pipeline_stage,
            last_stage_layers=self.num_layers_in_last_pipeline_stage,
            account_for_embedding=self.account_for_embedding_in_pipeline_split,
            account_for_loss=self.account_for_loss_in_pipeline_split,
            placement=self.pipeline_placement,
            stage_layers=None if custom is None else custom.decoder_layers(),
        )

    @property
    def gated_linear_unit(self) -> bool:
        """Megatron's flag: fc1 produces [gate, up] (SwiGLU, quick-GeGLU)."""
        return self.activation in ("swiglu", "quick_geglu")

    @property
    def activation_func(self) -> Any:
        """The elementwise function applied to fc1's output (to the gate half if gated)."""
        if self.activation == "quick_geglu":
            return quick_gelu
        return F.silu if self.activation == "swiglu" else F.gelu

    def is_window_attention_layer(self, layer_number: int) -> bool:
        """Whether layer `layer_number` (global, 1-based) attends through `window_size`
        (Megatron's is_layer_window_attention)."""
        if self.window_size is None or self.window_size[0] < 0:
            return False
        freq = self.window_attn_skip_freq
        if freq is None:
            return True
        if isinstance(freq, int):
            return layer_number % freq != 0
        # MTP layers (numbered past num_layers) follow the last decoder layer, as for MoE
        return bool(freq[min(layer_number, len(freq)) - 1])

    @property
    def rotary_dim(self) -> int:
        """Head dims rotated by RoPE: int(kv_channels * rotary_percent) (MLA: of the
        qk_pos_emb_head_dim positional dims)."""
        assert self.kv_channels is not None, "__post_init__ sets kv_channels"
        dims = self.qk_pos_emb_head_dim if self.multi_latent_attention else self.kv_channels
        return int(dims * self.rotary_percent)

    @property
    def query_projection_size(self) -> int:
        assert self.kv_channels is not None, "__post_init__ sets kv_channels"
        return self.kv_channels * self.num_attention_heads

    @property
    def kv_projection_size(self) -> int:
        assert self.kv_channels is not None, "__post_init__ sets kv_channels"
        assert self.num_query_groups is not None, "__post_init__ sets num_query_groups"
        return self.kv_channels * self.num_query_groups

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None

    @property
    def expert_tp_size(self) -> int:
        """expert_tensor_parallel_size, defaulting to tensor_model_parallel_size."""
        if self.expert_tensor_parallel_size is None:
            return self.tensor_model_parallel_size
        return self.expert_tensor_parallel_size

    @property
    def moe_ffn_size(self) -> int:
        """Hidden units of one routed expert (moe_ffn_hidden_size, else ffn_hidden_size)."""
        assert self.ffn_hidden_size is not None, "__post_init__ sets ffn_hidden_size"
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def moe_layer_pattern(self) -> list[bool]:
        """Per global layer (0-based): True where the MLP is a MoE layer."""
        if not self.is_moe:
            return [False] * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return [i % freq == 0 for i in range(self.num_layers)]
        return [bool(x) for x in freq]

    def is_moe_layer(self, layer_number: int) -> bool:
        """Layer `layer_number` (1-based) has a MoE MLP. Numbers past `num_layers` are the
        MTP layers (`num_layers + depth`): each is built like the last decoder layer
        (Megatron's MTP spec is the decoder's last layer spec)."""
        pattern = self.moe_layer_pattern()
        return pattern[min(layer_number, self.num_layers) - 1]

    @property
    def num_layers_with_mtp(self) -> int:
        """Decoder layers plus MTP layers (Megatron's count for aux-loss tracking)."""
        return self.num_layers + (self.mtp_num_layers or 0)

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return not self.untie_embeddings_and_output_weights


@functools.lru_cache(maxsize=16)
def _parse_layout(layout: str | tuple[tuple[str, ...], ...], pp: int) -> PipelineLayout:
    # stage_layout() runs once per layer built; the string is parsed once
    return PipelineLayout.parse(layout, pp)
