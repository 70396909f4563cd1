"""Parameter count = sum of the model's tensor sizes; FLOPs = Megatron's closed form,
checked against an independent per-GEMM count."""

from __future__ import annotations

import pytest

from pentatron.models import (
    GPTModel,
    TransformerConfig,
    flops_per_token,
    get_gpt_layer_local_spec,
    num_floating_point_operations,
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
    """Forward GEMM FLOPs of one sequence, times 3 (forward, dgrad, wgrad)."""
    d, nq, ng, h = c.kv_channels, c.num_attention_heads, c.num_query_groups, c.hidden_size
    fc1 = c.ffn_hidden_size * (2 if c.gated_linear_unit else 1)
    per_layer = (
        2 * s * h * (nq + 2 * ng) * d  # linear_qkv
        + 2 * s * s * nq * d * 2  # q k^T and p v
        + 2 * s * nq * d * h  # linear_proj
        + 2 * s * h * fc1
        + 2 * s * c.ffn_hidden_size * h  # fc1, fc2
    )
    return 3 * (c.num_layers * per_layer + 2 * s * h * vocab)


@pytest.mark.parametrize("kw", CONFIGS)
def test_flops_match_independent_gemm_count(kw):
    config = _config(**kw)
    got = num_floating_point_operations(config, 24, 128, batch_size=2)
    assert got == pytest.approx(2 * _gemm_flops(config, 24, 128), rel=1e-12)
    assert flops_per_token(config, 24, 128) == pytest.approx(got / 48, rel=1e-12)
