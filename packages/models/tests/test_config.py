"""Bad input fails at construction with a message naming the field, the rule and a fix."""

from __future__ import annotations

import pytest

from pentatron.models import HAVE_TE, ModelConfigError, TransformerConfig, get_gpt_layer_te_spec

BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=8)
V = dict(pipeline_placement="v", pipeline_model_parallel_size=2)
V_UNTIED = dict(**V, untie_embeddings_and_output_weights=True)

CASES = [
    (dict(tensor_model_parallel_size=3), "num_attention_heads=8"),
    (dict(num_query_groups=3), "num_query_groups=3"),
    (dict(num_query_groups=2, tensor_model_parallel_size=4), "num_query_groups=2"),
    (dict(pipeline_model_parallel_size=3), "num_layers=4 does not fit"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4), "num_layers=4"),
    (dict(ffn_hidden_size=66, tensor_model_parallel_size=4), "ffn_hidden_size=66"),
    (dict(normalization="BatchNorm"), "normalization='BatchNorm'"),
    (dict(activation="relu"), "activation='relu'"),
    (dict(position_embedding_type="alibi"), "position_embedding_type='alibi'"),
    (dict(rope_scaling={"factor": 8.0}), "rope_scaling="),
    (dict(recompute_granularity="full"), "recompute_method=None"),
    (dict(recompute_granularity="selective", recompute_num_layers=1), "recompute_method"),
    (dict(recompute_method="uniform"), "recompute_granularity=None"),
    (dict(hidden_dropout=1.0), "hidden_dropout=1.0"),
    (dict(hidden_size=60, num_attention_heads=8), "kv_channels"),
    (dict(position_embedding_type="rope", kv_channels=6, rotary_percent=0.5), "rotary_percent"),
    (dict(fp8="hybrid", recompute_granularity="selective"), "recompute_granularity='selective'"),
    # ZBV's V: two chunks per rank, untied embeddings, no MTP, an even split over 2p stages
    (dict(**V, virtual_pipeline_model_parallel_size=2), "untie_embeddings_and_output_weights"),
    (dict(**V_UNTIED, virtual_pipeline_model_parallel_size=2, mtp_num_layers=1), "mtp_num_layers"),
    (dict(**V_UNTIED, virtual_pipeline_model_parallel_size=4, num_layers=8), "vpp=4"),
    (
        {**V_UNTIED, "pipeline_model_parallel_size": 4, "virtual_pipeline_model_parallel_size": 2},
        "num_layers=4",
    ),
    (dict(pipeline_placement="zigzag"), "pipeline_placement"),
]


@pytest.mark.parametrize("overrides,field", CASES)
def test_bad_config_names_field_rule_and_fix(overrides, field):
    with pytest.raises(ModelConfigError) as info:
        TransformerConfig(**{**BASE, **overrides})
    message = str(info.value)
    assert field in message and "rule" in message and "fix" in message


def test_defaults_follow_megatron():
    c = TransformerConfig(**BASE)
    assert (c.num_query_groups, c.kv_channels, c.ffn_hidden_size) == (8, 8, 256)
    assert c.share_embeddings_and_output_weights and not c.gated_linear_unit
    assert c.apply_query_key_layer_scaling is False
    assert TransformerConfig(**BASE, activation="swiglu").gated_linear_unit


@pytest.mark.skipif(HAVE_TE, reason="transformer-engine is installed")
def test_te_spec_without_te_says_how_to_fix():
    with pytest.raises(ModelConfigError, match="transformer-engine"):
        get_gpt_layer_te_spec()


@pytest.mark.skipif(HAVE_TE, reason="transformer-engine is installed")
def test_te_linears_without_te_fail_or_fall_back_as_documented():
    from pentatron.models.te_spec import (
        TEColumnParallelLinear,
        TELayerNormColumnParallelLinear,
        TERowParallelLinear,
    )
    from pentatron.tp_layers import TPConfigError

    with pytest.raises(TPConfigError, match="transformer-engine"):
        TERowParallelLinear(8, 8, input_is_parallel=True)
    with pytest.raises(TPConfigError, match="transformer-engine"):
        TEColumnParallelLinear(8, 16, stride=2)
    with pytest.raises(TPConfigError, match="transformer-engine"):
        TELayerNormColumnParallelLinear(8, 16, config=TransformerConfig(**BASE))


def test_v_placement_puts_the_first_and_the_last_stage_on_rank_0():
    """What the HF converter (and the app) build per chunk: rank 0 chunk 0 has the
    embedding and layer 0, rank 0 chunk 1 layer 3 and the output layer (pp 2, 4 layers)."""
    from pentatron.models.hf.convert import stage_flags
    from pentatron.models.transformer_block import get_layer_offset

    config = TransformerConfig(**BASE, **V_UNTIED, virtual_pipeline_model_parallel_size=2)
    got = {
        (r, c): (stage_flags(config, r, c), get_layer_offset(config, r, c))
        for r in range(2)
        for c in range(2)
    }
    assert got == {
        (0, 0): ((True, False), 0),
        (1, 0): ((False, False), 1),
        (1, 1): ((False, False), 2),
        (0, 1): ((False, True), 3),
    }
    loop = TransformerConfig(**{**BASE, **V_UNTIED, "pipeline_placement": "loop"},
                             virtual_pipeline_model_parallel_size=2)  # fmt: skip
    assert stage_flags(loop, 1, 1) == (False, True) and get_layer_offset(loop, 0, 1) == 2
