"""gpt-oss's attention and activation: sliding windows, softmax sinks, quick-GeGLU with a
clamp and a linear offset (Megatron's --window-size, --window-attn-skip-freq,
--softmax-type, --quick-geglu, --activation-func-clamp-value, --glu-linear-offset).

References written apart from the code under test:
- attention: Megatron's unfused maths (explicit scores, the sink logit as one more softmax
  column, dropped after), fp64; and transformers' gpt-oss `eager_attention_forward` with
  its sliding-window mask function;
- the activation: transformers' gpt-oss `GptOssExperts._apply_gate` formula.
Parity: the whole model at tp2+SP, tp4 and tp2-pp2+SP against one process, losses and the
gradient of every parameter (the sinks' too); a planted bug (every tp rank taking the first
heads' sinks) makes it fail.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _gpt import GPT_OSS, microbatches, reference_run, small_config
from test_parity import _all_layouts, assert_matches_reference

from pentatron.models import ModelConfigError
from pentatron.models import attention as attention_module
from pentatron.models.activations import mlp_activation
from pentatron.models.attention import DotProductAttention


def _reference_attention(q, k, v, sinks, scale, left):
    """Megatron's local path: scores, causal/window mask, [scores, sink] softmax, drop the
    sink column, @ v. q [b, n, s, d], k/v [b, g, s, d], sinks [n] or None."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) * scale
    s = q.size(2)
    i, j = torch.arange(s).view(s, 1), torch.arange(s).view(1, s)
    allowed = j <= i
    if left is not None:
        allowed &= j >= i - left
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return probs @ v


def _inputs(dtype=torch.float64, s=12, heads=4, groups=2, d=8):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, 2, heads, d, generator=g, dtype=dtype)
    k = torch.randn(s, 2, groups, d, generator=g, dtype=dtype)
    v = torch.randn(s, 2, groups, d, generator=g, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v)]


@pytest.mark.parametrize(
    ("softmax_type", "window"),
    [("vanilla", (3, 0)), ("learnable", None), ("learnable", (3, 0)), ("off-by-one", (0, 0))],
)
def test_attention_matches_the_unfused_maths(softmax_type, window):
    config = small_config(
        num_layers=1,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        softmax_type=softmax_type,
        window_size=window,
        init_method_std=1.0,  # sinks of the scores' size, so they matter
        params_dtype=torch.float64,
    )
    core = DotProductAttention(config, layer_number=1, tp_size=1)
    q, k, v = _inputs()
    out = core(q, k, v)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, [q, k, v, *core.parameters()], grad_out)

    sinks = core.softmax_offset
    ref_sinks = (
        None if sinks is None else sinks.detach().clone().requires_grad_(sinks.requires_grad)
    )
    qb, kb, vb = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    ref = _reference_attention(qb, kb, vb, ref_sinks, 1 / math.sqrt(8), window and window[0])
    ref = ref.permute(2, 0, 1, 3).reshape(out.shape)
    wrt = [q, k, v] + ([ref_sinks] if softmax_type == "learnable" else [])
    want = torch.autograd.grad(ref, wrt, grad_out)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)
    if softmax_type == "off-by-one":  # a fixed zero logit: a buffer, not a parameter
        assert list(core.parameters()) == [] and torch.equal(
            sinks, torch.zeros(4, dtype=sinks.dtype)
        )


def test_attention_matches_transformers_gpt_oss():
    """transformers' gpt-oss eager attention (sinks as a softmax column, max-subtracted)
    with its own sliding-window mask (window 4: keys i-3 .. i), fp32."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    masks = pytest.importorskip("transformers.masking_utils")
    config = small_config(
        num_layers=1,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        softmax_type="learnable",
        window_size=(3, 0),
        init_method_std=1.0,
    )
    core = DotProductAttention(config, layer_number=1, tp_size=1)
    q, k, v = _inputs(torch.float32)
    out = core(q, k, v)

    keep = masks.sliding_window_causal_mask_function(4)
    s = q.size(0)
    i, j = torch.arange(s).view(s, 1), torch.arange(s).view(1, s)
    allowed = keep(torch.tensor(0), torch.tensor(0), i, j)
    additive = torch.zeros(s, s).masked_fill(~allowed, float("-inf"))
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups = core.softmax_offset, 2
    module.training = False
    qb, kb, vb = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    ref, _ = gpt_oss.eager_attention_forward(module, qb, kb, vb, additive, 1 / math.sqrt(8))
    ref = ref.transpose(0, 1).reshape(out.shape)  # [b, s, n, d] -> [s, b, n d]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("freq", "windowed"), [(None, [1, 2, 3, 4]), (2, [1, 3]), ([1, 1, 0, 1], [1, 2, 4])]
)
def test_which_layers_have_the_window(freq, windowed):
    """Megatron's is_layer_window_attention: N -> layer l (1-based) full when l % N == 0
    (gpt-oss: sliding, full, sliding, ...); a list gives 1 for sliding."""
    config = small_config(window_size=(3, 0), window_attn_skip_freq=freq)
    got = [n for n in range(1, 5) if DotProductAttention(config, n, 1).window == 3]
    assert got == windowed
    # an MTP layer (numbered num_layers + depth) follows the last decoder layer
    assert config.is_window_attention_layer(5) == (4 in windowed or isinstance(freq, int))


def test_the_transformer_engine_attention_refuses_the_variants_by_name():
    from pentatron.models.te_spec import TEDotProductAttention

    for kw in ({"softmax_type": "off-by-one"}, {"window_size": (3, 0)}):
        with pytest.raises(ModelConfigError, match=r"^softmax_type=.*fix: the local spec"):
            TEDotProductAttention(small_config(**kw), layer_number=1, tp_size=1)


def _apply_gate_reference(x, limit, offset):
    """transformers' gpt-oss gate (alpha 1.702), halves split [gate, up] as Megatron's."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + offset) * (gate * torch.sigmoid(gate * 1.702))


@pytest.mark.parametrize("clamp", [0.3, None])
def test_quick_geglu_matches_the_gpt_oss_formula(clamp):
    config = small_config(
        activation="quick_geglu", glu_linear_offset=1.0, activation_func_clamp_value=clamp
    )
    x = torch.randn(6, 2, 2 * 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x.requires_grad_()
    out = mlp_activation(config, x)
    ref = _apply_gate_reference(x, clamp if clamp is not None else math.inf, 1.0)
    grad = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, x, grad)
    (want,) = torch.autograd.grad(ref, x, grad)
    torch.testing.assert_close(out, ref, rtol=1e-14, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    if clamp is not None:  # the clamp was active: some grads are exactly zero
        assert (x.detach().abs() > clamp).any() and (got == 0).any()


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"window_size": (3, 2)}, "window_size"),
        ({"window_size": (-2, 0)}, "window_size"),
        ({"window_attn_skip_freq": 2}, "window_attn_skip_freq"),
        ({"window_size": (3, 0), "window_attn_skip_freq": [1, 0]}, "window_attn_skip_freq"),
        ({"softmax_type": "sigmoid"}, "softmax_type"),
        ({"softmax_type": "learnable", "attention_backend": "flash"}, "attention_backend"),
        (
            {"window_size": (3, 0), "multi_latent_attention": True, "num_query_groups": None},
            "window_size",
        ),
        ({"activation": "gelu", "glu_linear_offset": 1.0}, "activation"),
        (
            {"activation": "quick_geglu", "activation_func_clamp_value": 0.0},
            "activation_func_clamp_value",
        ),
    ],
)
def test_bad_settings_fail_naming_the_field(overrides, field):
    with pytest.raises(ModelConfigError, match=f"^{field}=.*the rule: .*fix: "):
        small_config(**overrides)


# ---- parallel parity -------------------------------------------------------------------

LAYOUTS = [  # (tp, pp, vpp, sequence_parallel, tied, spec)
    (2, 1, None, True, True, "local"),
    (4, 1, None, False, True, "local"),
    (2, 2, None, True, True, "local"),
]


def test_gpt_oss_model_matches_one_process(distributed):
    base, data = small_config(**GPT_OSS), microbatches()
    state, ref_losses, ref_grads = reference_run(base, data)
    per_rank = distributed.run(4, _all_layouts, base, LAYOUTS, {True: state}, data)
    for i, layout in enumerate(LAYOUTS):
        grads = assert_matches_reference(
            base, [r[i] for r in per_rank], layout, ref_losses, ref_grads
        )
        sinks = [n for n in grads if n.endswith("core_attention.softmax_offset")]
        assert len(sinks) == base.num_layers  # the sinks' grads were compared


def _tp2_initial_sinks(base):
    """This rank's sinks of every layer, the model built at tp2 from seed 0 (no load)."""
    from _gpt import DIVISIBLE_BY, VOCAB, S, with_layout

    from pentatron.models import build_model_chunks, get_gpt_layer_local_spec
    from pentatron.parallel_state import (
        ParallelConfig,
        destroy_model_parallel,
        initialize_model_parallel,
    )

    grid = initialize_model_parallel(ParallelConfig(tp=2))
    try:
        torch.manual_seed(0)
        (chunk,) = build_model_chunks(
            with_layout(base, 2, 1, None, False),
            get_gpt_layer_local_spec(),
            VOCAB,
            S,
            grid,
            make_vocab_size_divisible_by=DIVISIBLE_BY,
        )
        sinks = {
            n: p.detach().clone()
            for n, p in chunk.named_parameters()
            if n.endswith("softmax_offset")
        }
        return grid.rank("tp"), sinks
    finally:
        destroy_model_parallel(grid)


def _tp2_initial_sinks_first_heads_only(base):
    kept = attention_module.sink_shard_rank
    attention_module.sink_shard_rank = lambda group: 0  # the planted bug
    try:
        return _tp2_initial_sinks(base)
    finally:
        attention_module.sink_shard_rank = kept


@pytest.mark.parametrize("planted", [False, True], ids=["as-built", "planted-first-heads"])
def test_sinks_start_from_one_master_at_every_tp(distributed, planted):
    """Built (not loaded) at tp2, each rank's sinks are its heads' part of the one-process
    model's sinks, bitwise. Planted: every rank takes the first heads' part -> rank 1
    differs in every layer."""
    from _gpt import build_reference

    base = small_config(**GPT_OSS)
    want = {n: p for n, p in build_reference(base).state_dict().items() if "softmax_offset" in n}
    assert len(want) == base.num_layers
    func = _tp2_initial_sinks_first_heads_only if planted else _tp2_initial_sinks
    ranks = dict(distributed.run(2, func, base))
    merged = {n: torch.cat([ranks[0][n], ranks[1][n]]) for n in ranks[0]}
    assert merged.keys() == want.keys()
    same = [torch.equal(merged[n], want[n]) for n in want]
    assert same == ([False] * base.num_layers if planted else [True] * base.num_layers)


@pytest.mark.parametrize("round_to_int", [False, True], ids=["gpt-oss", "truncated"])
def test_yarn_rope_for_standard_attention_matches_transformers(round_to_int):
    """position_embedding_type="yarn" (Megatron's YarnRotaryEmbedding; gpt-oss: factor 32,
    beta 32 / 1, 4096 original positions, no rounding of the correction range): cos and sin
    equal transformers' gpt-oss rotary embedding, its attention factor included."""
    hf = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from pentatron.models.rope import RotaryEmbedding

    config = small_config(
        position_embedding_type="yarn",
        kv_channels=16,
        rotary_base=150000.0,
        rotary_scaling_factor=32.0,
        yarn_correction_range_round_to_int=round_to_int,
    )
    hf_config = hf.GptOssConfig(
        hidden_size=32, num_attention_heads=8, head_dim=16, num_key_value_heads=4
    )
    hf_config.rope_parameters["truncate"] = round_to_int
    ref = GptOssRotaryEmbedding(hf_config)
    pos = torch.arange(0, 6000, 97)[None]
    want_cos, want_sin = ref(torch.zeros(1, pos.size(1), 32), pos)  # [1, s, d/2]
    cos, sin = RotaryEmbedding(config, yarn=True)(pos, pos.size(1))  # [s, 1, 1, d]
    assert ref.attention_scaling > 1.3  # the concentration factor is in both
    torch.testing.assert_close(cos[:, 0, 0, :8], want_cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[:, 0, 0, :8], want_sin[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sinks", [False, True], ids=["window", "window-sinks"])
@pytest.mark.parametrize(("s", "left"), [(13, 3), (16, 3), (9, 4), (7, 6), (5, 0), (40, 7)])
def test_windows_blockwise_and_whole_match_the_unfused_maths(monkeypatch, s, left, sinks):
    """A window over a long sequence runs blockwise: one SDPA call whose keys per query
    block are the 2 left + 1 it can see, not s (counted); a short one runs as one masked
    call over all s keys. Both equal Megatron's unfused maths (fp64, 1e-12), the sequence
    a multiple of the block or not, with and without sinks."""
    from pentatron.models import attention_variants

    calls = []
    real = attention_variants.grouped_sdpa

    def counted(q, k, v, **kw):
        calls.append(k.size(2))
        return real(q, k, v, **kw)

    monkeypatch.setattr(attention_variants, "grouped_sdpa", counted)
    q, k, v = (x.permute(1, 2, 0, 3) for x in _inputs(s=s))
    a = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    a = a.requires_grad_() if sinks else None
    out = attention_variants.variant_sdpa(
        q, k, v, sinks=a, window=left, keep=None, dropout_p=0.0, scale=0.3, attention_backend="auto"
    )
    blockwise = -(-s // (left + 1)) >= attention_variants.MIN_WINDOW_BLOCKS
    sink_key = 1 if sinks else 0
    assert calls == [2 * left + 1 + sink_key if blockwise else s + sink_key]
    ref_sinks = None if a is None else a.detach().clone().requires_grad_()
    ref = _reference_attention(q, k, v, ref_sinks, 0.3, left)
    grad = torch.randn_like(out)
    wrt = [q, k, v] + ([a] if sinks else [])
    got = torch.autograd.grad(out, wrt, grad)
    want = torch.autograd.grad(ref, [q, k, v] + ([ref_sinks] if sinks else []), grad)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-11, atol=1e-12)
