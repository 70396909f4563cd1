"""Parameter count = sum of the model's tensor sizes; FLOPs = Megatron-LM's current closed form
(training.py `transformer_flops`, commit d98e8a64), each expected number written out here
term by term from the model shape, and checked against an independent per-GEMM count.

Megatron's terms per token, 6 = 3 GEMMs per weight (forward, dgrad, wgrad) x 2 FLOPs per
multiply-add: attention projections 6 (h (q + 2 kv) + q h) per layer; core attention 6 q s
per layer (q k^T and p v, 2 q s^2 multiply-adds, half of them under the causal mask); MLP
6 h f x 2 (3 with SwiGLU); a MoE layer 6 h (topk f_moe + f_shared) x 2 (or 3); logits 6 h V.
"""

from __future__ import annotations

import pytest

from pentatron.models import (
    GPTModel,
    TransformerConfig,
    flops_per_token,
    get_gpt_layer_local_spec,
    num_floating_point_operations,
    num_floating_point_operations_per_rank,
    num_parameters,
    num_parameters_in_model,
)

CONFIGS = [
    dict(),
    dict(
        activation="swiglu",
        normalization="RMSNorm",
        add_bias_linear=False,
        position_embedding_type="rope",
        num_query_groups=2,
    ),
    dict(
        untie_embeddings_and_output_weights=True,
        qk_layernorm=True,
        add_qkv_bias=True,
        add_bias_linear=False,
        kv_channels=16,
    ),
    dict(num_moe_experts=4, moe_ffn_hidden_size=24),  # biases: the router's [E] too
    dict(  # gpt-oss: learnable sinks (one per head), windows, quick-GeGLU
        activation="quick_geglu",
        glu_linear_offset=1.0,
        softmax_type="learnable",
        window_size=(7, 0),
        position_embedding_type="rope",
    ),
]


def _config(**kw):
    return TransformerConfig(
        num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, **kw
    )


@pytest.mark.parametrize("kw", CONFIGS)
def test_parameter_count_equals_sum_of_tensor_sizes(kw):
    config = _config(**kw)
    model = GPTModel(config, get_gpt_layer_local_spec(), 100, 24)
    assert num_parameters(config, model.padded_vocab_size, 24) == num_parameters_in_model(model)


def _gemm_flops(c, s, vocab):
    """Forward GEMM FLOPs of one sequence, times 3 (forward, dgrad, wgrad); the causal
    scores as Megatron counts them: s^2 / 2 (query, key) pairs."""
    d, nq, ng, h = c.kv_channels, c.num_attention_heads, c.num_query_groups, c.hidden_size
    fc1 = c.ffn_hidden_size * (2 if c.gated_linear_unit else 1)
    per_layer = (
        2 * s * h * (nq + 2 * ng) * d  # linear_qkv
        + 2 * (s * s // 2) * nq * d * 2  # q k^T and p v over the causal half
        + 2 * s * nq * d * h  # linear_proj
        + 2 * s * h * fc1
        + 2 * s * c.ffn_hidden_size * h  # fc1, fc2
    )
    return 3 * (c.num_layers * per_layer + 2 * s * h * vocab)


@pytest.mark.parametrize("kw", CONFIGS)
def test_flops_match_independent_gemm_count(kw):
    config = _config(**kw)
    got = num_floating_point_operations(config, 24, 128, batch_size=2)
    want = _gemm_flops(config, 24, 128)
    if config.activation == "quick_geglu":  # Megatron's formula skips its gate GEMM
        want -= 3 * config.num_layers * 2 * 24 * config.hidden_size * config.ffn_hidden_size
    assert got == pytest.approx(2 * want, rel=1e-12)
    assert flops_per_token(config, 24, 128) == pytest.approx(got / 48, rel=1e-12)


# --- one case per term: small shapes, h=64, 4 layers, s=32, V=256 -----------------------

L, H, S, V = 4, 64, 32, 256


def test_dense_mha():
    config = TransformerConfig(num_layers=L, hidden_size=H, num_attention_heads=4)
    d, f = 16, 4 * H  # kv_channels = h / heads; ffn = 4h
    q = kv = 4 * d  # MHA: 4 query heads, 4 key/value heads
    attn = 6 * (H * (q + kv + kv) + q * H)
    core = 6 * q * S
    mlp = 6 * H * f * 2
    logits = 6 * H * V
    expected = 3 * S * (L * (attn + core + mlp) + logits)
    assert num_floating_point_operations(config, S, V, batch_size=3) == pytest.approx(expected)
    assert flops_per_token(config, S, V) == pytest.approx(expected / (3 * S))


def test_gqa():
    config = TransformerConfig(
        num_layers=L, hidden_size=H, num_attention_heads=8, num_query_groups=2, kv_channels=16
    )
    q, kv, f = 8 * 16, 2 * 16, 4 * H
    attn = 6 * (H * (q + kv + kv) + q * H)
    core = 6 * q * S
    expected = S * (L * (attn + core + 6 * H * f * 2) + 6 * H * V)
    assert num_floating_point_operations(config, S, V) == pytest.approx(expected)
    mha = TransformerConfig(
        num_layers=L, hidden_size=H, num_attention_heads=8, num_query_groups=8, kv_channels=16
    )
    fewer_kv = S * L * 6 * H * 2 * (8 - 2) * 16  # k and v projections of 6 fewer groups
    assert num_floating_point_operations(mha, S, V) - expected == pytest.approx(fewer_kv)


def test_swiglu_counts_three_mlp_gemms():
    kw = dict(num_layers=L, hidden_size=H, num_attention_heads=4, ffn_hidden_size=96)
    gelu = TransformerConfig(**kw)
    swiglu = TransformerConfig(activation="swiglu", **kw)
    q = kv = H
    attn = 6 * (H * (q + 2 * kv) + q * H) + 6 * q * S
    logits = 6 * H * V
    expected_gelu = S * (L * (attn + 6 * H * 96 * 2) + logits)  # fc1 h->f, fc2 f->h
    expected_swiglu = S * (L * (attn + 6 * H * 96 * 3) + logits)  # fc1 h->2f, fc2 f->h
    assert num_floating_point_operations(gelu, S, V) == pytest.approx(expected_gelu)
    assert num_floating_point_operations(swiglu, S, V) == pytest.approx(expected_swiglu)
    # Megatron's formula reads --swiglu only: --quick-geglu counts as 2 GEMMs there
    quick = TransformerConfig(activation="quick_geglu", **kw)
    assert num_floating_point_operations(quick, S, V) == pytest.approx(expected_gelu)


def _moe(**kw):
    base = dict(
        num_layers=L,
        hidden_size=H,
        num_attention_heads=4,
        ffn_hidden_size=128,
        activation="swiglu",
        add_bias_linear=False,
        num_moe_experts=8,
    )
    return TransformerConfig(**(base | kw))


# attention + logits of the shapes `_moe` builds (h=64, MHA, 4 heads of 16)
_MOE_ATTN = 6 * (H * (H + 2 * H) + H * H) + 6 * H * S
_MOE_LOGITS = 6 * H * V


def test_moe_topk_one_two_and_dense_differ():
    dense = TransformerConfig(
        num_layers=L,
        hidden_size=H,
        num_attention_heads=4,
        ffn_hidden_size=128,
        activation="swiglu",
        add_bias_linear=False,
    )
    expected = {
        "dense": S * (L * (_MOE_ATTN + 6 * H * 128 * 3) + _MOE_LOGITS),
        "top1": S * (L * (_MOE_ATTN + 6 * H * 1 * 128 * 3) + _MOE_LOGITS),
        "top2": S * (L * (_MOE_ATTN + 6 * H * 2 * 128 * 3) + _MOE_LOGITS),
    }
    got = {
        "dense": num_floating_point_operations(dense, S, V),
        "top1": num_floating_point_operations(_moe(moe_router_topk=1), S, V),
        "top2": num_floating_point_operations(_moe(moe_router_topk=2), S, V),
    }
    assert got == pytest.approx(expected)
    assert got["top1"] == pytest.approx(got["dense"])  # one expert of the dense size
    assert got["top2"] - got["top1"] == pytest.approx(S * L * 6 * H * 128 * 3)


def test_moe_expert_ffn_size():
    config = _moe(moe_router_topk=2, moe_ffn_hidden_size=32)
    routed = 6 * H * 2 * 32 * 3  # topk x moe_ffn_hidden_size, not ffn_hidden_size
    expected = S * (L * (_MOE_ATTN + routed) + _MOE_LOGITS)
    assert num_floating_point_operations(config, S, V) == pytest.approx(expected)


def test_moe_shared_experts():
    config = _moe(moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=96)
    routed = 6 * H * 2 * 32 * 3
    shared = 6 * H * 96 * 3  # every token through the shared expert, SwiGLU
    expected = S * (L * (_MOE_ATTN + routed + shared) + _MOE_LOGITS)
    assert num_floating_point_operations(config, S, V) == pytest.approx(expected)


def test_moe_layer_freq_int():
    config = _moe(moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=2)
    moe_layers, dense_layers = 2, 2  # layers 0 and 2 (i % 2 == 0) are MoE
    expected = S * (
        L * _MOE_ATTN
        + dense_layers * 6 * H * 128 * 3
        + moe_layers * 6 * H * 2 * 32 * 3
        + _MOE_LOGITS
    )
    assert num_floating_point_operations(config, S, V) == pytest.approx(expected)


def test_moe_layer_freq_list():
    config = _moe(
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=64,
        moe_layer_freq=[0, 1, 1, 1],
    )
    moe_layers, dense_layers = 3, 1
    expected = S * (
        L * _MOE_ATTN
        + dense_layers * 6 * H * 128 * 3
        + moe_layers * (6 * H * 2 * 32 * 3 + 6 * H * 64 * 3)
        + _MOE_LOGITS
    )
    assert num_floating_point_operations(config, S, V) == pytest.approx(expected)


def test_logits_counted_once_tied_or_untied():
    kw = dict(num_layers=L, hidden_size=H, num_attention_heads=4)
    tied = TransformerConfig(**kw)
    untied = TransformerConfig(untie_embeddings_and_output_weights=True, **kw)
    assert num_floating_point_operations(tied, S, V) == num_floating_point_operations(untied, S, V)
    bigger = num_floating_point_operations(tied, S, 2 * V) - num_floating_point_operations(
        tied, S, V
    )
    assert bigger == pytest.approx(S * 6 * H * V)  # one h -> V GEMM per token


def test_per_rank_is_total_over_tp_pp_cp():
    config = TransformerConfig(
        num_layers=L,
        hidden_size=H,
        num_attention_heads=4,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
    )
    total = num_floating_point_operations(config, S, V, batch_size=5)
    assert num_floating_point_operations_per_rank(config, S, V, 5) == pytest.approx(total / 4)


# --- acceptance: published shapes ------------------------------------------------------


def test_gpt3_175b():
    L, h, heads, s, V, f = 96, 12288, 96, 2048, 51200, 4 * 12288
    config = TransformerConfig(num_layers=L, hidden_size=h, num_attention_heads=heads)
    q = kv = heads * 128
    attn = 6 * (h * (q + 2 * kv) + q * h)  # = 24 h^2
    core = 6 * q * s
    mlp = 6 * h * f * 2  # GeLU: fc1, fc2
    per_token = L * (attn + core + mlp) + 6 * h * V
    assert per_token == 1_061_947_441_152
    assert flops_per_token(config, s, V) == pytest.approx(per_token, rel=1e-12)
    got = num_floating_point_operations(config, s, V, batch_size=1)
    assert got == pytest.approx(s * per_token, rel=1e-12)


def _llama3_8b():
    return TransformerConfig(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        kv_channels=128,
        ffn_hidden_size=14336,
        activation="swiglu",
        normalization="RMSNorm",
        add_bias_linear=False,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
    )


def test_llama3_8b():
    L, h, s, V, f = 32, 4096, 8192, 128256, 14336
    q, kv = 32 * 128, 8 * 128
    attn = 6 * (h * (q + 2 * kv) + q * h)
    core = 6 * q * s
    mlp = 6 * h * f * 3  # SwiGLU: fc1 h -> 2f, fc2 f -> h
    per_token = L * (attn + core + mlp) + 6 * h * V
    assert per_token == 51_470_401_536
    config = _llama3_8b()
    assert flops_per_token(config, s, V) == pytest.approx(per_token, rel=1e-12)
    got = num_floating_point_operations(config, s, V, batch_size=1)
    assert got == pytest.approx(s * per_token, rel=1e-12)


def test_llama3_8b_counts_half_the_causal_scores():
    """Megatron before core 0.12: 12 b s L h^2 ((1 + ng/nq + s/h) q/h + 1.5 f/h + V/(2Lh)),
    all s^2 scores; now half. The difference is exactly the other half of the core term."""
    L, h, s, V, f, nq, ng = 32, 4096, 8192, 128256, 14336, 32, 8
    q = nq * 128
    old = 12 * s * L * h * h * ((1 + ng / nq + s / h) * (q / h) + 1.5 * f / h + V / (2 * L * h))
    new = num_floating_point_operations(_llama3_8b(), s, V)
    assert old - new == pytest.approx(s * L * 6 * q * s, rel=1e-12)
    assert old / new == pytest.approx(1.12517, abs=1e-5)  # the old formula read 12.5% high


def test_mixtral_8x7b():
    L, h, s, V, f, k = 32, 4096, 4096, 32000, 14336, 2
    config = TransformerConfig(
        num_layers=L,
        hidden_size=h,
        num_attention_heads=32,
        num_query_groups=8,
        kv_channels=128,
        ffn_hidden_size=f,
        activation="swiglu",
        normalization="RMSNorm",
        add_bias_linear=False,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
        num_moe_experts=8,
        moe_router_topk=k,
    )
    q, kv = 32 * 128, 8 * 128
    attn = 6 * (h * (q + 2 * kv) + q * h)
    core = 6 * q * s
    moe = 6 * h * k * f * 3  # each token through top-2 SwiGLU experts of ffn 14336
    per_token = L * (attn + core + moe) + 6 * h * V
    assert per_token == 79_706_456_064
    assert flops_per_token(config, s, V) == pytest.approx(per_token, rel=1e-12)
    got = num_floating_point_operations(config, s, V, batch_size=1)
    assert got == pytest.approx(s * per_token, rel=1e-12)


MLA_CONFIGS = [
    dict(q_lora_rank=24, qk_layernorm=True),
    dict(q_lora_rank=None, qk_layernorm=False, add_bias_linear=False),
]


@pytest.mark.parametrize("kw", MLA_CONFIGS, ids=["q-lora-norms", "q-direct"])
def test_mla_parameter_count_equals_sum_of_tensor_sizes(kw):
    config = _config(
        multi_latent_attention=True,
        position_embedding_type="rope",
        kv_lora_rank=20,
        qk_head_dim=8,
        qk_pos_emb_head_dim=4,
        v_head_dim=6,
        normalization="RMSNorm",
        **kw,
    )
    spec = get_gpt_layer_local_spec(multi_latent_attention=True)
    model = GPTModel(config, spec, 100, 24)
    assert num_parameters(config, model.padded_vocab_size, 24) == num_parameters_in_model(model)


def test_mla_flops_follow_megatrons_mla_branch():
    """Megatron's MLA terms written out: q lora h -> r_q -> n (d_qk + d_pe) with its `+ 1`
    (norm), kv lora h -> r_kv -> n (d_qk + d_v) (+ 1) and h -> d_pe, o proj n d_v -> h;
    core n (d_qk + d_pe) / 2 + n d_v / 2 per s^2 (causal half of q k^T and p v)."""
    n, r_q, r_kv, d_qk, d_pe, d_v = 4, 24, 20, 8, 4, 6
    mla = dict(kv_lora_rank=r_kv, qk_head_dim=d_qk, qk_pos_emb_head_dim=d_pe, v_head_dim=d_v)
    config = TransformerConfig(
        num_layers=L,
        hidden_size=H,
        num_attention_heads=n,
        multi_latent_attention=True,
        position_embedding_type="rope",
        q_lora_rank=r_q,
        **mla,
    )
    f = 4 * H
    attn = 6 * (r_q * (H + n * (d_qk + d_pe) + 1) + r_kv * (H + n * (d_qk + d_v) + 1))
    attn += 6 * (H * d_pe + n * d_v * H)
    core = 6 * (n * (d_qk + d_pe) / 2 + n * d_v / 2) * S
    expected = S * (L * (attn + core + 6 * H * f * 2) + 6 * H * V)
    assert num_floating_point_operations(config, S, V) == pytest.approx(expected, rel=1e-12)
    direct = TransformerConfig(
        num_layers=L,
        hidden_size=H,
        num_attention_heads=n,
        multi_latent_attention=True,
        position_embedding_type="rope",
        **mla,
    )
    q_change = 6 * (H * n * (d_qk + d_pe) - r_q * (H + n * (d_qk + d_pe) + 1))
    got = num_floating_point_operations(direct, S, V) - expected
    assert got == pytest.approx(S * L * q_change, rel=1e-12)


@pytest.mark.parametrize("kw", [CONFIGS[1], CONFIGS[2]], ids=["tied-rope", "untied"])
def test_mtp_parameter_count_equals_sum_of_tensor_sizes(kw):
    config = _config(mtp_num_layers=2, **kw)
    model = GPTModel(config, get_gpt_layer_local_spec(config.qk_layernorm), 100, 24)
    assert any(n.startswith("mtp.layers.1.") for n, _ in model.named_parameters())
    assert num_parameters(config, model.padded_vocab_size, 24) == num_parameters_in_model(model)


def test_mtp_flops_follow_megatrons_mtp_terms():
    """Megatron's MTP terms written out: D more layers (attention, core and MLP, dense here),
    D more logit GEMMs, and per depth 6 (3 h + 2 h^2) for its norms and eh_proj."""
    f, d = 4 * H, 2
    attn = 6 * (H * 3 * H + H * H)  # MHA: q = kv = h
    core = 6 * H * S  # per token: q k^T and p v over the causal half
    layer = attn + core + 6 * H * f * 2
    expected = S * ((L + d) * layer + 6 * H * V * (1 + d) + 6 * d * (3 * H + 2 * H * H))
    config = TransformerConfig(num_layers=L, hidden_size=H, num_attention_heads=4, mtp_num_layers=d)
    assert num_floating_point_operations(config, S, V) == pytest.approx(expected, rel=1e-12)


def test_mtp_layers_count_as_the_last_layers_mlp_kind():
    """A first dense layer then MoE: the MTP layer is MoE (its routed + shared FLOPs)."""
    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
    config = TransformerConfig(
        num_layers=L, hidden_size=H, num_attention_heads=4, moe_layer_freq=[0, 1, 1, 1], **moe
    )
    with_mtp = TransformerConfig(
        num_layers=L,
        hidden_size=H,
        num_attention_heads=4,
        moe_layer_freq=[0, 1, 1, 1],
        mtp_num_layers=1,
        **moe,
    )
    attn = 6 * (H * 3 * H + H * H) + 6 * H * S
    moe_mlp = 6 * H * 16 * 2 * 2  # topk 2 x moe_ffn 16 x 2 GEMMs
    extra = S * (attn + moe_mlp + 6 * H * V + 6 * (3 * H + 2 * H * H))
    got = num_floating_point_operations(with_mtp, S, V) - num_floating_point_operations(
        config, S, V
    )
    assert got == pytest.approx(extra, rel=1e-12)


def test_moe_mla_mtp_parameter_count_equals_sum_of_tensor_sizes():
    """A dense first layer, MoE layers with a shared expert (and its gate), MLA, one MTP
    depth (MoE, like the last layer): every tensor counted once."""
    config = TransformerConfig(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=48,
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        multi_latent_attention=True,
        qk_layernorm=True,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_head_dim=8,
        qk_pos_emb_head_dim=4,
        v_head_dim=6,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        moe_layer_freq=[0, 1, 1],
        moe_shared_expert_intermediate_size=24,
        moe_shared_expert_gate=True,
        moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid",
        mtp_num_layers=1,
        add_bias_linear=False,
    )
    spec = get_gpt_layer_local_spec(True, multi_latent_attention=True)
    model = GPTModel(config, spec, 100, 24)
    assert num_parameters(config, model.padded_vocab_size) == num_parameters_in_model(model)
    # active: two of the four experts of each of the 3 MoE layers (2 decoder + MTP)
    per_expert = 3 * 32 * 16
    got = num_parameters(config, model.padded_vocab_size, active=True)
    assert num_parameters(config, model.padded_vocab_size) - got == 3 * 2 * per_expert


def _deepseek_v3(**kw) -> TransformerConfig:
    """DeepSeek-V3's shape (its config.json): 61 layers, the first 3 dense."""
    return TransformerConfig(
        num_layers=61,
        hidden_size=7168,
        num_attention_heads=128,
        ffn_hidden_size=18432,
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        multi_latent_attention=True,
        qk_layernorm=True,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_head_dim=128,
        qk_pos_emb_head_dim=64,
        v_head_dim=128,
        num_moe_experts=256,
        moe_router_topk=8,
        moe_ffn_hidden_size=2048,
        moe_shared_expert_intermediate_size=2048,
        moe_layer_freq=[0] * 3 + [1] * 58,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=8,
        moe_router_group_topk=4,
        **kw,
    )


def test_deepseek_v3_totals_are_the_published_ones():
    """DeepSeek-V3 (arXiv 2412.19437): 671B parameters, 37B activated per token; the
    Hugging Face release holds 685B with the MTP module (14B, counting its copies of the
    embedding and output head, 2 x 0.93B)."""
    vocab = 129280
    total = num_parameters(_deepseek_v3(), vocab)
    active = num_parameters(_deepseek_v3(), vocab, active=True)
    assert total == pytest.approx(671e9, rel=1e-3), total
    assert 37e9 <= active < 38e9, active  # "37B activated" (37.55B)
    with_mtp = num_parameters(_deepseek_v3(mtp_num_layers=1), vocab)
    copies = 2 * vocab * 7168
    assert with_mtp + copies == pytest.approx(685e9, rel=1e-3), with_mtp + copies
