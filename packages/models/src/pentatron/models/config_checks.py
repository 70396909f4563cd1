"""Validation of TransformerConfig's context-parallel and Mixture-of-Experts fields.

Kept apart from `config.py` so the dense checks stay one screen each; every check raises
`ModelConfigError` naming the field, the rule and a fix, before any process group exists.
"""

from __future__ import annotations

import math
from typing import Any

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")
TOKEN_DROP_POLICIES = ("probs", "position")
TOKEN_DISPATCHERS = ("allgather", "alltoall")
ROUTER_DTYPES = (None, "fp32", "fp64")
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
# Megatron's recompute_modules that this release implements (see transformer_layer.py)
RECOMPUTE_MODULES = (
    "core_attn",
    "mlp",
    "layernorm",
    "moe",
    "moe_act",
    "shared_experts",
    "mla_up_proj",
)
# Megatron's names for architectures this release does not have
RECOMPUTE_MODULES_ELSEWHERE = {
    "gdn_norm_out": "GatedDeltaNet attention",
    "gdp_in_proj": "GatedDeltaProduct attention",
    "gdp_qkv": "GatedDeltaProduct attention",
    "mhc": "hyper-connections (mHC)",
}


class ModelConfigError(ValueError):
    """A model setting that cannot work; the message names the field, the rule and a fix."""


def fail(field_name: str, value: Any, rule: str, fix: str) -> None:
    raise ModelConfigError(f"{field_name}={value!r}: the rule: {rule}; fix: {fix}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(name: str, value: Any, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not _is_int(value) or value < 1:
        fail(name, value, "must be a positive integer", f"set {name} >= 1")


def _choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        fail(name, value, f"one of {allowed}", f"set {name} to one of {allowed}")


def _non_negative(name: str, value: Any, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, (int, float)) or value < 0:
        fail(name, value, "a number >= 0", f"e.g. {name}=0.0")


def check_recompute_modules(c: Any) -> None:
    """Megatron's rules for `recompute_modules` (read only with selective granularity)."""
    mods = c.recompute_modules
    if isinstance(mods, str) or not isinstance(mods, (list, tuple)):
        fail(
            "recompute_modules",
            mods,
            "a list of module names",
            'e.g. recompute_modules=["core_attn"] (a list, also for one name)',
        )
    if c.recompute_granularity != "selective":
        return  # Megatron ignores the list then
    for name in mods:
        if name in RECOMPUTE_MODULES_ELSEWHERE:
            fail(
                "recompute_modules",
                list(mods),
                f"{name!r} recomputes part of {RECOMPUTE_MODULES_ELSEWHERE[name]}, which is "
                "not in this release",
                f"drop {name!r}; this release recomputes {list(RECOMPUTE_MODULES)}",
            )
        if name not in RECOMPUTE_MODULES:
            fail(
                "recompute_modules",
                list(mods),
                f"{name!r} is not a module name; the names are {list(RECOMPUTE_MODULES)}",
                f"use names from {list(RECOMPUTE_MODULES)}",
            )
    if "mla_up_proj" in mods and not c.multi_latent_attention:
        fail(
            "recompute_modules",
            list(mods),
            "'mla_up_proj' recomputes multi-latent attention's up-projections",
            "set multi_latent_attention=True or drop 'mla_up_proj'",
        )
    if "moe_act" in mods and not c.moe_grouped_gemm:
        fail(
            "recompute_modules",
            list(mods),
            "'moe_act' recomputes the grouped experts' activation: it needs "
            "moe_grouped_gemm=True (as Megatron)",
            "set moe_grouped_gemm=True or drop 'moe_act'",
        )
    if "shared_experts" in mods and c.moe_shared_expert_overlap:
        fail(
            "recompute_modules",
            list(mods),
            "'shared_experts' recompute cannot run with moe_shared_expert_overlap (the shared "
            "experts run on a side stream during the dispatch)",
            "set moe_shared_expert_overlap=False or drop 'shared_experts'",
        )


def check_glu(c: Any) -> None:
    """--glu-linear-offset and --activation-func-clamp-value act on a gated activation's two
    halves (activations.py); Megatron's unfused path reads them for any gated activation."""
    offset, clamp = c.glu_linear_offset, c.activation_func_clamp_value
    if not isinstance(offset, (int, float)) or isinstance(offset, bool) or offset != offset:
        fail("glu_linear_offset", offset, "a finite number", "e.g. glu_linear_offset=0.0")
    if clamp is not None and (not isinstance(clamp, (int, float)) or not 0 < clamp < float("inf")):
        fail(
            "activation_func_clamp_value",
            clamp,
            "a finite number > 0 (fc1's output is clamped to it)",
            "e.g. activation_func_clamp_value=7.0, or None for no clamp",
        )
    if (offset != 0.0 or clamp is not None) and not c.gated_linear_unit:
        fail(
            "activation",
            c.activation,
            "glu_linear_offset and activation_func_clamp_value act on the [gate, up] halves "
            "of a gated activation",
            "use activation='quick_geglu' or 'swiglu' (app: --quick-geglu or --swiglu), or "
            "drop them",
        )


def check_attention_variants(c: Any) -> None:
    """softmax_type, window_size and window_attn_skip_freq (gpt-oss's attention)."""
    _choice("softmax_type", c.softmax_type, SOFTMAX_TYPES)
    w, freq = c.window_size, c.window_attn_skip_freq
    if w is not None:
        if (
            not isinstance(w, (tuple, list))
            or len(w) != 2
            or not all(_is_int(x) for x in w)
            or w[0] < -1
        ):
            fail(
                "window_size",
                w,
                "(left, right): two integers, left >= 0 or -1 (no window)",
                "e.g. window_size=(127, 0) (gpt-oss: 128 keys including the query's own)",
            )
        if w[1] != 0:
            fail(
                "window_size",
                tuple(w),
                "GPT attention is causal, so the window's right side must be 0",
                f"use window_size=({w[0]}, 0)",
            )
    if freq is not None:
        if w is None:
            fail("window_attn_skip_freq", freq, "needs window_size", "set window_size or drop it")
        if _is_int(freq):
            _positive("window_attn_skip_freq", freq)
        elif (
            not isinstance(freq, (list, tuple))
            or len(freq) != c.num_layers
            or any(x not in (0, 1) for x in freq)
        ):
            fail(
                "window_attn_skip_freq",
                freq,
                f"an integer N >= 1, or a 0/1 list of num_layers={c.num_layers} entries "
                "(1: sliding window)",
                "e.g. window_attn_skip_freq=2 (every second layer full)",
            )
    if c.softmax_type == "vanilla" and w is None:
        return
    what = "softmax_type=" + repr(c.softmax_type) if w is None else "window_size"
    if c.multi_latent_attention:
        fail(
            what,
            w if w is not None else c.softmax_type,
            "sliding windows and softmax sinks are built for grouped-query attention only "
            "(as Megatron's MLA)",
            "drop them, or multi_latent_attention=False",
        )
    if c.attention_backend == "flash":
        fail(
            "attention_backend",
            "flash",
            f"with {what} attention passes SDPA an explicit mask, which its flash kernel "
            "does not take on CUDA",
            "attention_backend='auto' (or 'fused', 'unfused')",
        )


def check_context_parallel(c: Any) -> None:
    cp = c.context_parallel_size
    _positive("context_parallel_size", cp)
    _choice("cp_comm_type", c.cp_comm_type, CP_COMM_TYPES)
    if cp > 1 and c.cp_comm_type != "a2a" and c.attention_backend == "fused":
        fail(
            "attention_backend",
            c.attention_backend,
            f"with context_parallel_size={cp} and cp_comm_type={c.cp_comm_type!r} attention "
            "runs blockwise on the flash kernel (context_parallel/block_kernels.py) or "
            "PyTorch's maths, never on cuDNN's fused kernel",
            "use attention_backend='auto' or 'flash' (or 'unfused'), or cp_comm_type='a2a', "
            "whose attention is one SDPA call",
        )
    a2a = _check_hierarchical_cp(c, cp)
    if cp > 1 and a2a > 1:
        split = c.tensor_model_parallel_size * a2a
        for name in ("num_attention_heads", "num_query_groups"):
            value = getattr(c, name)
            if value % split:
                fail(
                    name,
                    value,
                    f"cp_comm_type={c.cp_comm_type!r} shards heads over tp*{a2a} = {split} "
                    f"(tp times the all-to-all's size), so {name} must be a multiple of it",
                    "use cp_comm_type='p2p' or 'all_gather', or a context_parallel_size (with "
                    f"a2a+p2p, an all-to-all size) that divides {name} / tp",
                )


def _check_hierarchical_cp(c: Any, cp: int) -> int:
    """The sizes of "a2a+p2p" -> how many ranks its all-to-all spans (cp for "a2a", 1 for
    the others)."""
    sizes = c.hierarchical_context_parallel_sizes
    if sizes is not None:
        if (
            not isinstance(sizes, (list, tuple))
            or not sizes
            or any(not isinstance(x, int) or x < 1 for x in sizes)
        ):
            fail(
                "hierarchical_context_parallel_sizes",
                sizes,
                "a list of positive sizes, one per level",
                f"e.g. [2, {max(cp // 2, 1)}] for context_parallel_size={cp}",
            )
        if math.prod(sizes) != cp:
            fail(
                "hierarchical_context_parallel_sizes",
                sizes,
                f"the levels' sizes multiply to context_parallel_size={cp} "
                f"(here {math.prod(sizes)})",
                f"sizes whose product is {cp}",
            )
    if c.cp_comm_type != "a2a+p2p":
        return cp if c.cp_comm_type == "a2a" else 1
    if sizes is None or len(sizes) != 2:
        fail(
            "hierarchical_context_parallel_sizes",
            sizes,
            "cp_comm_type='a2a+p2p' takes two levels, [all-to-all size, ring size]",
            f"e.g. [2, {max(cp // 2, 1)}] for context_parallel_size={cp}",
        )
    return sizes[0]


def check_moe(c: Any) -> None:
    _choice("moe_router_dtype", c.moe_router_dtype, ROUTER_DTYPES)
    if c.num_moe_experts is None:
        _check_dense_has_no_experts(c)
        return
    experts = c.num_moe_experts
    _positive("num_moe_experts", experts)
    _check_router(c, experts)
    _check_capacity(c)
    _choice("moe_token_dispatcher_type", c.moe_token_dispatcher_type, TOKEN_DISPATCHERS)
    _check_expert_parallel(c, experts)
    _check_layer_freq(c)
    if c.tensor_model_parallel_size > 1 and not c.sequence_parallel:
        fail(
            "sequence_parallel",
            False,
            "MoE with tensor_model_parallel_size > 1 needs sequence parallelism (as Megatron): "
            "the router and dispatcher work on each rank's [s/t, b, h] tokens",
            "set sequence_parallel=True",
        )
    _positive("moe_shared_expert_intermediate_size", c.moe_shared_expert_intermediate_size, True)
    shared = c.moe_shared_expert_intermediate_size
    if shared is not None and shared % c.tensor_model_parallel_size:
        fail(
            "moe_shared_expert_intermediate_size",
            shared,
            "shared experts are split like the dense MLP, so the size must be a multiple of "
            f"tensor_model_parallel_size={c.tensor_model_parallel_size}",
            "choose a multiple of tp",
        )
    if c.moe_shared_expert_overlap and (
        shared is None or c.moe_token_dispatcher_type != "alltoall"
    ):
        fail(
            "moe_shared_expert_overlap",
            True,
            "overlapping the shared expert with the dispatch needs shared experts and the "
            "alltoall dispatcher",
            "set moe_shared_expert_intermediate_size and moe_token_dispatcher_type='alltoall', "
            "or moe_shared_expert_overlap=False",
        )


def _check_dense_has_no_experts(c: Any) -> None:
    if c.expert_model_parallel_size != 1:
        fail(
            "expert_model_parallel_size",
            c.expert_model_parallel_size,
            "expert parallelism needs experts",
            "set num_moe_experts or expert_model_parallel_size=1",
        )


def _check_router(c: Any, experts: int) -> None:
    topk = c.moe_router_topk
    _positive("moe_router_topk", topk)
    if topk > experts:
        fail(
            "moe_router_topk",
            topk,
            f"each token picks topk of num_moe_experts={experts} experts",
            f"set moe_router_topk <= {experts}",
        )
    _choice("moe_router_score_function", c.moe_router_score_function, SCORE_FUNCTIONS)
    _choice(
        "moe_router_load_balancing_type", c.moe_router_load_balancing_type, LOAD_BALANCING_TYPES
    )
    if c.moe_router_pre_softmax and c.moe_router_score_function != "softmax":
        fail(
            "moe_router_pre_softmax",
            True,
            "pre-softmax routing applies to the softmax score function",
            "set moe_router_score_function='softmax' or moe_router_pre_softmax=False",
        )
    scale = c.moe_router_topk_scaling_factor
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        fail("moe_router_topk_scaling_factor", scale, "None or > 0", "e.g. 1.0 or None")
    _non_negative("moe_aux_loss_coeff", c.moe_aux_loss_coeff)
    _non_negative("moe_z_loss_coeff", c.moe_z_loss_coeff, optional=True)
    if c.moe_router_load_balancing_type == "sinkhorn" and c.moe_aux_loss_coeff:
        fail(
            "moe_aux_loss_coeff",
            c.moe_aux_loss_coeff,
            "sinkhorn routing balances without an aux loss",
            "set moe_aux_loss_coeff=0 with moe_router_load_balancing_type='sinkhorn'",
        )
    if c.moe_router_enable_expert_bias and c.moe_router_score_function != "sigmoid":
        fail(
            "moe_router_enable_expert_bias",
            True,
            "aux-loss-free expert bias works with the sigmoid score function (as Megatron)",
            "set moe_router_score_function='sigmoid' or moe_router_enable_expert_bias=False",
        )
    rate = c.moe_router_bias_update_rate
    if not (isinstance(rate, (int, float)) and rate > 0):
        fail("moe_router_bias_update_rate", rate, "> 0", "e.g. 1e-3")
    eps = c.moe_input_jitter_eps
    if eps is not None and not (isinstance(eps, (int, float)) and eps > 0):
        fail("moe_input_jitter_eps", eps, "None or > 0", "e.g. 1e-2 or None")
    _check_groups(c, experts, topk)


def _check_groups(c: Any, experts: int, topk: int) -> None:
    groups, group_topk = c.moe_router_num_groups, c.moe_router_group_topk
    if groups is None and group_topk is None:
        return
    if groups is None or group_topk is None:
        fail(
            "moe_router_group_topk" if groups is not None else "moe_router_num_groups",
            None,
            "group-limited routing needs both moe_router_num_groups and moe_router_group_topk",
            "set both (e.g. num_groups=8, group_topk=4) or neither",
        )
    _positive("moe_router_num_groups", groups)
    _positive("moe_router_group_topk", group_topk)
    if experts % groups:
        fail(
            "moe_router_num_groups",
            groups,
            f"groups split num_moe_experts={experts} evenly",
            f"use a divisor of {experts}",
        )
    if group_topk > groups:
        fail(
            "moe_router_group_topk",
            group_topk,
            f"at most moe_router_num_groups={groups}",
            f"set moe_router_group_topk <= {groups}",
        )
    if topk < group_topk:
        fail(
            "moe_router_group_topk",
            group_topk,
            f"a group is scored by the sum of its top topk/group_topk experts, so "
            f"group_topk <= moe_router_topk={topk}",
            f"set moe_router_group_topk <= {topk}",
        )
    if topk > group_topk * (experts // groups):
        fail(
            "moe_router_topk",
            topk,
            f"the chosen groups hold group_topk * experts/groups = {group_topk * (experts // groups)} "
            "experts, at least topk",
            "raise moe_router_group_topk or lower moe_router_topk",
        )


def _check_capacity(c: Any) -> None:
    cf = c.moe_expert_capacity_factor
    if cf is not None and not (isinstance(cf, (int, float)) and cf > 0):
        fail("moe_expert_capacity_factor", cf, "None (no dropping) or > 0", "e.g. 1.0")
    _choice("moe_token_drop_policy", c.moe_token_drop_policy, TOKEN_DROP_POLICIES)
    if cf is not None and c.moe_router_load_balancing_type == "sinkhorn":
        fail(
            "moe_expert_capacity_factor",
            cf,
            "token dropping works with aux_loss, seq_aux_loss or none balancing",
            "unset the capacity factor or change moe_router_load_balancing_type",
        )
    if c.moe_pad_expert_input_to_capacity and cf is None:
        fail(
            "moe_pad_expert_input_to_capacity",
            True,
            "padding to capacity needs a capacity",
            "set moe_expert_capacity_factor or moe_pad_expert_input_to_capacity=False",
        )


def _check_expert_parallel(c: Any, experts: int) -> None:
    ep = c.expert_model_parallel_size
    _positive("expert_model_parallel_size", ep)
    _positive("expert_tensor_parallel_size", c.expert_tensor_parallel_size, optional=True)
    if experts % ep:
        fail(
            "num_moe_experts",
            experts,
            f"experts are split evenly over expert_model_parallel_size={ep}",
            f"use a number of experts that is a multiple of {ep}, or an ep that divides {experts}",
        )
    _positive("moe_ffn_hidden_size", c.moe_ffn_hidden_size, optional=True)
    etp, ffn = c.expert_tp_size, c.moe_ffn_size
    if ffn % etp:
        fail(
            "moe_ffn_hidden_size",
            ffn,
            f"an expert's hidden units are split over expert_tensor_parallel_size={etp}",
            "choose a multiple of the expert tensor-parallel size",
        )


def _check_layer_freq(c: Any) -> None:
    freq, n = c.moe_layer_freq, c.num_layers
    if _is_int(freq):
        _positive("moe_layer_freq", freq)
        return
    if (
        not isinstance(freq, (list, tuple))
        or len(freq) != n
        or any(x not in (0, 1) or isinstance(x, float) for x in freq)
    ):
        fail(
            "moe_layer_freq",
            freq,
            f"an int n (every n-th layer is MoE) or a list of num_layers={n} zeros and ones",
            "e.g. moe_layer_freq=[0] + [1] * (num_layers - 1) for a first dense layer",
        )


def check_mla(c: Any) -> None:
    """Multi-latent attention (`multi_latent_attention`): its shapes, and what it runs with.

    Supported: any tp (heads split; the down-projections duplicated on every tp rank, as
    Megatron's transformer-engine spec), sequence parallelism, pipeline and virtual stages,
    context parallelism (every cp_comm_type; V travels zero-padded to q/k's head dim), MoE,
    recompute, YaRN (`rotary_scaling_factor` > 1). Not yet: the transformer-engine layout
    (refused by the spec, naming the fix)."""
    if not c.multi_latent_attention:
        if c.rotary_scaling_factor != 1.0 and c.position_embedding_type != "yarn":
            fail(
                "rotary_scaling_factor",
                c.rotary_scaling_factor,
                "YaRN scales standard attention's RoPE with position_embedding_type='yarn' "
                "(and multi-latent attention's)",
                "set position_embedding_type='yarn', or use rope_scaling (Llama 3)",
            )
        return
    if not c.rotary_scaling_factor >= 1.0:
        fail("rotary_scaling_factor", c.rotary_scaling_factor, ">= 1 (1: no YaRN)", "e.g. 40")
    _positive("yarn_original_max_position_embeddings", c.yarn_original_max_position_embeddings)
    _positive("q_lora_rank", c.q_lora_rank, optional=True)
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        _positive(name, getattr(c, name))
    if c.position_embedding_type != "rope":
        fail(
            "position_embedding_type",
            c.position_embedding_type,
            "multi-latent attention rotates its qk_pos_emb_head_dim dims with RoPE",
            "use position_embedding_type='rope'",
        )
    if c.qk_pos_emb_head_dim % 2:
        fail("qk_pos_emb_head_dim", c.qk_pos_emb_head_dim, "RoPE pairs dims: even", "use 64")
    if c.rope_scaling is not None:
        fail(
            "rope_scaling",
            c.rope_scaling,
            "Llama-3 RoPE scaling does not apply to multi-latent attention (it takes YaRN)",
            "use rope_scaling=None and rotary_scaling_factor for YaRN",
        )
    # The down-projections are duplicated over tp (mla.py): no rank count divides them.


def check_mtp(c: Any) -> None:
    """Multi-token prediction (`mtp_num_layers`): its sizes.

    Supported with every layout (tp, sp, pp and vpp: the MTP layers sit on the last
    pipeline stage, after its decoder layers; cp; ep), dense or MoE, recompute, either
    attention. The MTP layers are built like the last decoder layer."""
    if c.mtp_num_layers is None:
        return
    _positive("mtp_num_layers", c.mtp_num_layers)
    value = c.mtp_loss_scaling_factor
    if not (isinstance(value, (int, float)) and 0.0 <= value < float("inf")):
        fail(
            "mtp_loss_scaling_factor",
            value,
            "a finite weight >= 0 of the MTP loss",
            "use e.g. 0.1 (Megatron's default) or 0.3 (DeepSeek-V3's first phase)",
        )
