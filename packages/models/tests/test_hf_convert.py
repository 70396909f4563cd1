"""Hugging Face Llama <-> GPTModel in one process: config mapping, refusals, logits, round trip.

Reference: transformers' LlamaForCausalLM with random weights (std 0.2, so every tensor
matters), fp32, logits compared with atol=rtol=1e-4 on random tokens. Round trip:
`to_hf(from_hf(m))` equals `m.state_dict()` tensor by tensor (torch.equal).
"""

import pytest
import torch

from pentatron.models import GPTModel, TransformerConfig, get_gpt_layer_local_spec
from pentatron.models.hf import (
    DictSource,
    HFConfigError,
    chunk_param_names,
    config_from_hf,
    config_to_hf_dict,
    full_to_hf,
    read_shard,
)
from pentatron.models.sharding import shard_full_tensor

TOL = {"atol": 1e-4, "rtol": 1e-4}
V = 100
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

CASES = {
    "mha-untied": {"num_key_value_heads": 4, "tie_word_embeddings": False},
    "gqa-tied": {"num_key_value_heads": 2, "tie_word_embeddings": True},
    "gqa-llama3": {"num_key_value_heads": 2, "rope_scaling": LLAMA3, "rope_theta": 5e5},
    "mqa-headdim-bias": {
        "num_key_value_heads": 1,
        "head_dim": 12,
        "attention_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": True,
        "rope_scaling": LLAMA3,
    },
}


def llama_config(**kw):
    transformers = pytest.importorskip("transformers")
    base = {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": V,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
    }
    return transformers.LlamaConfig(**{**base, **kw})


def llama(seed=0, **kw):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(llama_config(**kw)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_and_round_trip(case):
    from pentatron.models.hf import from_hf, to_hf

    hf = llama(**CASES[case])
    ours = from_hf(hf).eval()
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids, None)
    assert got.shape == (2, 24, ours.padded_vocab_size)
    torch.testing.assert_close(got[..., :V], want, **TOL)
    back, ref = to_hf(ours), hf.state_dict()
    assert set(back) == set(ref)
    for name, t in ref.items():
        assert torch.equal(back[name], t), name


def test_rope_scaling_changes_logits():
    """The llama3 case above is discriminating: dropping the scaling changes the logits."""
    from pentatron.models.hf import from_hf

    hf = llama(**CASES["gqa-llama3"])
    cfg = hf.config.to_dict()
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    plain = from_hf(hf.state_dict(), cfg).eval()
    ids = torch.randint(0, V, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert not torch.allclose(plain(ids, None)[..., :V], hf(ids).logits, atol=1e-3)


def test_config_mapping_both_ways():
    hf = llama_config(num_key_value_heads=2, rope_scaling=LLAMA3, rope_theta=5e5, head_dim=16)
    config, vocab, max_seq, extras = config_from_hf(hf)
    assert (config.num_layers, config.hidden_size, config.num_attention_heads) == (2, 32, 4)
    assert (config.num_query_groups, config.kv_channels, config.ffn_hidden_size) == (2, 16, 48)
    assert config.normalization == "RMSNorm" and config.activation == "swiglu"
    assert config.layernorm_epsilon == 1e-5 and config.rotary_base == 5e5
    assert config.rope_scaling.factor == 8.0
    assert config.rope_scaling.original_max_position_embeddings == 16
    assert config.untie_embeddings_and_output_weights and not config.add_bias_linear
    assert (vocab, max_seq) == (V, 64)
    d = config_to_hf_dict(config, vocab, max_seq, extras)
    again = config_from_hf(d)
    assert again[0] == config and again[1:3] == (vocab, max_seq)
    # The transformers-4 layout (rope_theta + rope_scaling with "type") reads the same.
    old = config_to_hf_dict(config, vocab, max_seq, extras, rope_parameters=False)
    old["rope_scaling"] = {**old["rope_scaling"], "type": old["rope_scaling"].pop("rope_type")}
    assert config_from_hf(old)[0] == config


def test_config_overrides_win_over_the_mapped_fields():
    """`overrides` may name a field the mapping sets (dropout for fine-tuning); it wins
    (it raised "got multiple values for keyword argument")."""
    config = config_from_hf(llama_config(), hidden_dropout=0.1, qk_layernorm=True)[0]
    assert config.hidden_dropout == 0.1 and config.qk_layernorm
    assert config_from_hf(llama_config(), sequence_parallel=True)[0].hidden_dropout == 0.0


def test_config_to_hf_builds_a_llama_config():
    transformers = pytest.importorskip("transformers")
    from pentatron.models.hf import config_to_hf

    config, vocab, max_seq, extras = config_from_hf(
        llama_config(num_key_value_heads=2, rope_scaling=LLAMA3, tie_word_embeddings=True)
    )
    hf = config_to_hf(config, vocab, max_seq, extras)
    assert isinstance(hf, transformers.LlamaConfig)
    assert config_from_hf(hf)[0] == config


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_parameters.rope_type"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters.rope_type"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type"),
        ({"attention_bias": True, "mlp_bias": False}, "attention_bias"),
        ({"sliding_window": 128}, "sliding_window"),
        ({"model_type": "gpt2"}, "model_type"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
            "rope_parameters.low_freq_factor",
        ),
    ],
)
def test_unsupported_hf_config_names_the_field(change, field):
    d = {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": V,
    }
    if "rope_scaling" in change:
        d["rope_theta"] = 1e4
    with pytest.raises(HFConfigError, match=f"config {field}="):
        config_from_hf({**d, **change})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("normalization", "LayerNorm"),
        ("activation", "gelu"),
        ("qk_layernorm", True),
        ("softmax_type", "learnable"),  # gpt-oss's variants: GptOss form only (quick-GeGLU)
        ("window_size", (7, 0)),
        ("glu_linear_offset", 1.0),
        ("activation_func_clamp_value", 7.0),
    ],
)
def test_unrepresentable_config_refused_by_config_to_hf(field, value):
    kw = {"normalization": "RMSNorm", "activation": "swiglu", "position_embedding_type": "rope"}
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, **{**kw, field: value}
    )
    with pytest.raises(HFConfigError, match=f"{field}="):
        config_to_hf_dict(config, V, 64)


@pytest.mark.parametrize("tp", [2, 4])
def test_sliced_reads_equal_the_core_sharding_of_the_full_tensor(tp):
    """`read_shard` at tp=t (reading slices of q/k/v, gate/up, ...) == the core helper's
    `shard_full_tensor` of the tp=1 tensor: both define the same layout independently."""
    hf = llama(num_key_value_heads=4, attention_bias=True, mlp_bias=True, intermediate_size=64)
    src = DictSource(hf.state_dict())
    config = config_from_hf(hf.config)[0]
    names = chunk_param_names(
        config, pre_process=True, post_process=True, layer_offset=0, num_layers=2
    )
    for name in names:
        full = read_shard(name, src, config, vocab_size=V, padded_vocab_size=V)
        for r in range(tp):
            got = read_shard(
                name, src, config, tp_rank=r, tp_size=tp, vocab_size=V, padded_vocab_size=128
            )
            want = shard_full_tensor(name, full, r, tp, config=config, padded_vocab_size=128)
            assert torch.equal(got, want), (name, r)
    assert (
        full_to_hf(
            {n: read_shard(n, src, config, vocab_size=V, padded_vocab_size=V) for n in names},
            config,
            V,
        ).keys()
        == hf.state_dict().keys()
    )


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize(("pre", "post"), [(True, True), (True, False), (False, True)])
def test_chunk_param_names_match_gpt_model(tied, pre, post):
    config, vocab, max_seq, _ = config_from_hf(
        {
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "vocab_size": V,
            "tie_word_embeddings": tied,
            "attention_bias": True,
            "mlp_bias": True,
        }
    )
    if tied and not pre:
        pytest.skip("a tied last stage without the first needs pp > 1 (covered multi-rank)")
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab, max_seq, pre, post)
    names = chunk_param_names(
        config, pre_process=pre, post_process=post, layer_offset=0, num_layers=2
    )
    assert names == list(model.state_dict())
