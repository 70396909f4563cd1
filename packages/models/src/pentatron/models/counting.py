"""Parameter and FLOP counts of a GPT, in closed form (for logging and memory estimates).

`num_parameters` counts the full (tp=1) model from its config; it equals the sum of the
tensor sizes of the single-process GPTModel. `num_floating_point_operations` is
Megatron-LM's current formula (training.py `transformer_flops`), 6 = 3 GEMMs per weight
(forward, dgrad, wgrad) x 2 FLOPs per multiply-add, per token:
  attention  6 L (h (q + 2 kv) + q h)                      q = nq d, kv = ng d
  core       6 L q s        (q k^T and p v; the causal mask keeps half of the s^2 scores)
  (multi-latent attention: Megatron's MLA branch, `_mla_flops_per_layer`)
  MLP        6 h (f g L_dense + (topk f_moe + f_shared) g L_moe)    g = 3 SwiGLU, else 2
             (quick-GeGLU: 2, as Megatron's formula, which reads --swiglu only)
  logits     6 h V (1 + D)  (the output GEMM, tied or not, once per MTP depth too)
  MTP        6 D (3 h + 2 h^2)   (its three norms and eh_proj; D = mtp_num_layers)
with L_moe the MoE layers of `moe_layer_freq`. MTP layers count as D more layers in the
attention and MLP terms, MoE if the last decoder layer is (Megatron's rule). Before Megatron core 0.12 the core term
counted all s^2 scores (12 L q s). Without attention terms it is the familiar 6N.
`num_floating_point_operations_per_rank` divides the model total by tp * pp * cp.
"""

from __future__ import annotations

import torch

from .config import TransformerConfig


def _norm_params(config: TransformerConfig, size: int) -> int:
    return size * (2 if config.normalization == "LayerNorm" else 1)


def _mla_parameters(config: TransformerConfig) -> int:
    """One MLA block: q (direct, or down + norm + up), kv down (+ k_pe) + norm + up, proj."""
    h, n = config.hidden_size, config.num_attention_heads
    q_out = n * (config.qk_head_dim + config.qk_pos_emb_head_dim)
    r_q, r_kv = config.q_lora_rank, config.kv_lora_rank
    norms = config.qk_layernorm
    q = (
        h * q_out
        if r_q is None
        else r_q * (h + q_out) + (_norm_params(config, r_q) if norms else 0)
    )
    kv = h * (r_kv + config.qk_pos_emb_head_dim) + r_kv * n * (
        config.qk_head_dim + config.v_head_dim
    )
    kv += _norm_params(config, r_kv) if norms else 0
    proj = n * config.v_head_dim * h + (h if config.add_bias_linear else 0)
    return q + kv + proj


def _attention_parameters(config: TransformerConfig) -> int:
    h, d = config.hidden_size, config.kv_channels
    assert d is not None, "TransformerConfig.__post_init__ fills it in"
    if config.multi_latent_attention:
        return _mla_parameters(config)
    qkv_out = config.query_projection_size + 2 * config.kv_projection_size
    bias = config.add_bias_linear
    attn = h * qkv_out + (qkv_out if bias or config.add_qkv_bias else 0)
    attn += config.query_projection_size * h + (h if bias else 0)
    if config.qk_layernorm:
        attn += 2 * _norm_params(config, d)
    if config.softmax_type == "learnable":
        attn += config.num_attention_heads  # one sink logit per head
    return attn


def _dense_mlp_parameters(config: TransformerConfig, ffn: int) -> int:
    fc1_out = ffn * (2 if config.gated_linear_unit else 1)
    bias = config.add_bias_linear
    return (
        config.hidden_size * fc1_out
        + ffn * config.hidden_size
        + ((fc1_out + config.hidden_size) if bias else 0)
    )


def _moe_parameters(config: TransformerConfig, active: bool) -> int:
    """Router `[E, h]` (+ `[E]` bias), E experts (`active`: only the top-k a token uses), shared experts
    (a dense MLP, with Qwen2-MoE's gate `[1, h]`); the expert bias is a buffer."""
    h, experts = config.hidden_size, config.num_moe_experts
    assert experts is not None, "a MoE layer has experts"
    used = config.moe_router_topk if active else experts
    router = experts * h + (experts if config.add_bias_linear else 0)  # + its logit bias
    n = router + used * _dense_mlp_parameters(config, config.moe_ffn_size)
    shared = config.moe_shared_expert_intermediate_size
    if shared:
        n += _dense_mlp_parameters(config, shared) + (h if config.moe_shared_expert_gate else 0)
    return n


def num_parameters_per_layer(
    config: TransformerConfig, moe: bool = False, active: bool = False
) -> int:
    """One decoder layer: attention, its MLP (dense, or MoE with `moe`: all experts, or the
    top-k a token uses with `active`) and its two norms."""
    assert config.ffn_hidden_size is not None, "TransformerConfig.__post_init__ fills it in"
    if moe:
        mlp = _moe_parameters(config, active)
    else:
        mlp = _dense_mlp_parameters(config, config.ffn_hidden_size)
    return _attention_parameters(config) + mlp + 2 * _norm_params(config, config.hidden_size)


def num_parameters(
    config: TransformerConfig,
    padded_vocab_size: int,
    max_sequence_length: int = 0,
    share_embeddings_and_output_weights: bool | None = None,
    *,
    active: bool = False,
) -> int:
    """Parameters of the whole model (all stages, tp=1); tied embeddings counted once.

    `active`: those one token uses (MoE layers count their top-k experts only; DeepSeek's
    "activated parameters"). MTP depths count their own tensors (norms, eh_proj, a layer
    of the last decoder layer's kind), not the embedding and output layer they share."""
    tied = (
        config.share_embeddings_and_output_weights
        if share_embeddings_and_output_weights is None
        else share_embeddings_and_output_weights
    )
    h = config.hidden_size
    n = _norm_params(config, h) + padded_vocab_size * h * (1 if tied else 2)
    for layer in range(1, config.num_layers_with_mtp + 1):
        n += num_parameters_per_layer(config, config.is_moe_layer(layer), active)
    n += (config.mtp_num_layers or 0) * (3 * _norm_params(config, h) + 2 * h * h)
    if config.position_embedding_type == "learned_absolute":
        n += max_sequence_length * h
    return n


def num_parameters_in_model(model: torch.nn.Module) -> int:
    """Sum of the sizes of a module's parameters (this rank's shards)."""
    return sum(p.numel() for p in model.parameters())


# 3 GEMMs per weight (forward, dgrad, wgrad) x 2 FLOPs per multiply-add (Megatron's
# forward_backward_expansion_factor * fma_expansion_factor).
_FWD_BWD_FMA = 3 * 2


def _mlp_kinds(config: TransformerConfig) -> tuple[int, int]:
    """(dense MLP layers, MoE layers) by `moe_layer_pattern` (moe_layer_freq int or list),
    the MTP layers counted as the last decoder layer's kind (Megatron's rule)."""
    pattern = config.moe_layer_pattern()
    pattern += [pattern[-1]] * (config.mtp_num_layers or 0)
    num_moe = sum(pattern)
    return len(pattern) - num_moe, num_moe


def _mlp_flops_per_token(config: TransformerConfig) -> int:
    """Token-linear MLP FLOPs of all layers: dense `f`, routed `topk * moe_f`, shared `f_sh`.

    Each MLP is fc1 (h -> f, or h -> 2f stacked [gate, up] for SwiGLU) and fc2 (f -> h):
    2 GEMMs of h f, 3 with SwiGLU (Megatron's ffn_expansion_factor; the 1.5x). Megatron's
    formula reads `args.swiglu` only, so gpt-oss's quick-GeGLU counts 2 there although fc1
    is stacked [gate, up] too; it counts 2 here as well, so that logged TFLOP/s compare
    with Megatron's (they understate a quick-GeGLU model's MLP work by a third).
    """
    assert config.ffn_hidden_size is not None, "TransformerConfig.__post_init__ fills it in"
    gemms = 3 if config.activation == "swiglu" else 2
    dense_layers, moe_layers = _mlp_kinds(config)
    dense = config.ffn_hidden_size * gemms * dense_layers
    moe = 0
    if moe_layers:
        # moe_latent_size (routed experts on a latent dim) would change the routed term.
        routed = config.moe_ffn_size * config.moe_router_topk * gemms
        shared = (config.moe_shared_expert_intermediate_size or 0) * gemms
        moe = (routed + shared) * moe_layers
    return _FWD_BWD_FMA * config.hidden_size * (dense + moe)


def _attention_flops_per_layer(config: TransformerConfig) -> tuple[int, float]:
    """(token-linear FLOPs per token, core FLOPs per s^2) of one self-attention layer.

    Token-linear: linear_qkv (h -> q + 2 kv) and linear_proj (q -> h). Core: q k^T and
    p v, 2 s^2 q multiply-adds, of which the causal mask keeps half (Megatron core >= 0.12;
    before, all s^2 were counted). Multi-latent attention: Megatron's MLA branch.
    """
    if config.multi_latent_attention:
        return _mla_flops_per_layer(config)
    h, q, kv = config.hidden_size, config.query_projection_size, config.kv_projection_size
    linear = _FWD_BWD_FMA * (h * (q + 2 * kv) + q * h)
    core = _FWD_BWD_FMA * 2 * q // 2  # q k^T and p v: 2 GEMMs of s^2 q; causal keeps half
    return linear, core


def _mla_flops_per_layer(config: TransformerConfig) -> tuple[int, float]:
    """Megatron's MLA terms (training.py, d98e8a64): the token-linear projections, counting
    the latent norms and RoPE as one multiply-add per latent element (its `+ 1`s), and the
    core q k^T over d_qk + d_pe dims and p v over d_v, half of each under the causal mask."""
    h, n = config.hidden_size, config.num_attention_heads
    d_qk, d_pe, d_v = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
    if config.q_lora_rank is None:
        q_term = h * n * (d_qk + d_pe)
    else:
        q_term = config.q_lora_rank * (h + n * (d_qk + d_pe) + 1)
    kv_term = config.kv_lora_rank * (h + n * (d_qk + d_v) + 1) + h * d_pe
    linear = _FWD_BWD_FMA * (q_term + kv_term + n * d_v * h)
    core = _FWD_BWD_FMA * (n * (d_qk + d_pe) / 2 + n * d_v / 2)
    return linear, core


def num_floating_point_operations(
    config: TransformerConfig, seq_length: int, padded_vocab_size: int, batch_size: int = 1
) -> float:
    """FLOPs of one training step (forward + backward) on `batch_size` sequences.

    Megatron's `transformer_flops` for equal-length (BSHD) sequences: the token-linear
    work times `b s` plus the core attention times `b s^2`.
    """
    tokens, squared = batch_size * seq_length, batch_size * seq_length * seq_length
    attn_linear, attn_core = _attention_flops_per_layer(config)
    # Logits: one h -> V GEMM whether the output layer is tied or not, and one per MTP depth;
    # MTP depths also add a layer each, their norms and eh_proj (Megatron's MTP terms).
    h, mtp = config.hidden_size, config.mtp_num_layers or 0
    layers = config.num_layers + mtp
    logits = _FWD_BWD_FMA * h * padded_vocab_size * (1 + mtp)
    mtp_extra = _FWD_BWD_FMA * mtp * (3 * h + 2 * h * h)
    token_linear = _mlp_flops_per_token(config) + attn_linear * layers + logits + mtp_extra
    return float(tokens * token_linear + squared * attn_core * layers)


def flops_per_token(config: TransformerConfig, seq_length: int, padded_vocab_size: int) -> float:
    """Training FLOPs per token: `num_floating_point_operations / (b s)`."""
    return num_floating_point_operations(config, seq_length, padded_vocab_size) / seq_length


def num_floating_point_operations_per_rank(
    config: TransformerConfig, seq_length: int, padded_vocab_size: int, batch_size: int = 1
) -> float:
    """FLOPs one rank does in one step on `batch_size` sequences of its data-parallel group.

    The model total (`num_floating_point_operations`, independent of the layout) is split
    evenly over tp (weights), pp (layers; the logits term is averaged over the stages) and
    cp: each cp rank holds s/cp tokens for every GEMM, and the causal load-balanced chunks
    (r, 2cp-1-r) give every cp rank the same share of the s^2 attention term.
    """
    total = num_floating_point_operations(config, seq_length, padded_vocab_size, batch_size)
    split = (
        config.tensor_model_parallel_size
        * config.pipeline_model_parallel_size
        * config.context_parallel_size
    )
    return total / split
