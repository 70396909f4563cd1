"""Hugging Face gpt-oss <-> GPTModel: config mapping both ways, refusals, logits, round trip,
MXFP4 experts, sharded reads at tp / ep / etp / pp, the CLI.

Reference: transformers' GptOssForCausalLM (eager attention: sinks as a softmax column,
its own sliding-window mask; YaRN RoPE; the clamped quick-GeGLU experts with biases),
random weights (std 0.2), fp32; logits within atol=rtol=1e-5 on random tokens (measured:
1.5e-7). The sequence (16) is longer than the window (4), so the windows matter. MXFP4:
our dequantisation is compared with transformers' own (`convert_moe_packed_tensors`),
exactly, and a checkpoint holding MXFP4 experts gives the logits of the HF model holding
their dequantised values. Sharded: every rank's tensors equal `shard_full_tensor` of the
single-process model's, bit for bit; at tp2 x ep2 (+SP, world 4) the sharded model's
logits equal transformers'.
"""

from __future__ import annotations

import json

import pytest
import torch

from pentatron.models.hf import (
    HFConfigError,
    SafetensorsDirSource,
    config_from_hf,
    config_to_hf,
    config_to_hf_dict,
    from_hf,
    hf_shard_state_dict,
    to_hf,
)
from pentatron.models.hf.mxfp4 import dequantize_mxfp4
from pentatron.models.sharding import global_param_name, shard_full_tensor
from pentatron.parallel_state import ParallelConfig, destroy_model_parallel
from pentatron.parallel_state import initialize_model_parallel as init_grid
from pentatron.tp_layers import pad_vocab_size

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gpt_oss")

V = 100
TOL = {"atol": 1e-5, "rtol": 1e-5}  # measured: 1.5e-7
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_BASE = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_hidden_layers": 4,
    "vocab_size": V,
    "max_position_embeddings": 131072,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "intermediate_size": 24,
    "sliding_window": 4,
    "swiglu_limit": 0.5,  # small enough that the clamps act on std-0.2 weights
    "rope_parameters": YARN,
}
CASES = {
    # gpt-oss's own shape: sliding / full alternating, YaRN, untied
    "alternating-yarn": {},
    # every layer windowed, plain RoPE, tied embeddings, MQA
    "all-sliding-rope-tied": {
        "layer_types": ["sliding_attention"] * 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
        "tie_word_embeddings": True,
        "num_key_value_heads": 1,
    },
    # a layer pattern of its own, YaRN with an explicit attention factor, rounded range
    "pattern-attention-factor": {
        "layer_types": [
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
        ],
        "rope_parameters": {**YARN, "attention_factor": 1.2, "truncate": True},
    },
}


def hf_config(case: str = "alternating-yarn", **kw):
    config = transformers.GptOssConfig(**{**_BASE, **CASES[case], **kw})
    config._attn_implementation = "eager"
    return config


def hf_model(case: str = "alternating-yarn", seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(hf_config(case, **kw)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _ids():
    return torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))


def _logits(model):
    with torch.no_grad():
        return model(_ids(), None)[..., :V]


def _hf_logits(hf):
    with torch.no_grad():
        return hf(_ids()).logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_and_round_trip(case):
    hf = hf_model(case)
    ours = from_hf(hf).eval()
    torch.testing.assert_close(_logits(ours), _hf_logits(hf), **TOL)
    back, ref = to_hf(ours), hf.state_dict()
    assert set(back) == set(ref)
    for name, t in ref.items():
        assert torch.equal(back[name], t), name


@pytest.mark.parametrize(
    "change",
    [
        {"sliding_window": None},
        {"layer_types": ["full_attention", "sliding_attention"] * 2},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},
        {"rope_parameters": {**YARN, "truncate": True}},
        {"swiglu_limit": 100.0},
    ],
    ids=["no-window", "other-layers", "no-yarn", "truncated-yarn", "no-clamp"],
)
def test_each_mapped_field_changes_the_logits(change):
    """The cases above are discriminating: our model built from a config that differs from
    the checkpoint's in one mapped field no longer gives transformers' logits within TOL
    (YaRN's rounded correction range moves them least: 4.6e-5)."""
    hf = hf_model()
    wrong = {**hf.config.to_dict(), **change}
    ours = from_hf(hf.state_dict(), wrong).eval()
    assert not torch.allclose(_logits(ours), _hf_logits(hf), **TOL)


def test_config_mapping_both_ways():
    config, vocab, max_seq, extras = config_from_hf(hf_config())
    assert (config.activation, config.glu_linear_offset) == ("quick_geglu", 1.0)
    assert config.activation_func_clamp_value == 0.5 and config.softmax_type == "learnable"
    assert config.window_size == (3, 0) and config.window_attn_skip_freq == 2
    assert [config.is_window_attention_layer(n) for n in range(1, 5)] == [1, 0, 1, 0]
    assert (config.position_embedding_type, config.rotary_scaling_factor) == ("yarn", 32.0)
    assert not config.yarn_correction_range_round_to_int
    assert config.yarn_original_max_position_embeddings == 4096
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_size) == (4, 2, 24)
    assert all(config.moe_layer_pattern()) and not config.moe_router_pre_softmax
    assert config.add_bias_linear and config.untie_embeddings_and_output_weights
    assert (vocab, max_seq) == (V, 131072)
    for case in CASES:
        config, vocab, max_seq, extras = config_from_hf(hf_config(case))
        for rope_parameters in (True, False):  # transformers 5's form and 4's
            d = config_to_hf_dict(config, vocab, max_seq, extras, rope_parameters=rope_parameters)
            assert config_from_hf(d)[0] == config, (case, rope_parameters)
    # keys left out take GptOssConfig's defaults, as transformers fills them in
    sparse = {k: v for k, v in hf_config().to_dict().items() if k in _BASE}
    for key in ("rope_parameters", "sliding_window", "head_dim", "layer_types"):
        sparse.pop(key, None)
    filled = transformers.GptOssConfig(**sparse)
    assert config_from_hf({**sparse, "model_type": "gpt_oss"})[0] == config_from_hf(filled)[0]
    custom, *_ = config_from_hf(hf_config("pattern-attention-factor"))
    assert custom.window_attn_skip_freq == [0, 1, 1, 0]
    assert custom.mscale_all_dim == 0.0  # 0.1 mscale ln(32) + 1 = 1.2
    assert abs(0.1 * custom.mscale * torch.log(torch.tensor(32.0)).item() + 1 - 1.2) < 1e-6


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_to_hf_builds_the_same_model(case):
    """config -> HF config -> HF model: the same tensors, the same logits (bitwise)."""
    hf = hf_model(case)
    config, vocab, max_seq, extras = config_from_hf(hf.config)
    hf_again = config_to_hf(config, vocab, max_seq, extras)
    hf_again._attn_implementation = "eager"
    again = transformers.GptOssForCausalLM(hf_again).eval()
    again.load_state_dict(hf.state_dict())
    torch.testing.assert_close(_hf_logits(again), _hf_logits(hf), atol=0, rtol=0)


def _raises(match, fn, *args, **kw):
    with pytest.raises(HFConfigError, match=match):
        fn(*args, **kw)


def test_bad_input_is_refused_with_the_field():
    d = hf_config().to_dict()
    _raises("attention_bias", config_from_hf, {**d, "attention_bias": False})
    _raises("swiglu_alpha", config_from_hf, {**d, "swiglu_alpha": 1.0})
    _raises("layer_types", config_from_hf, {**d, "layer_types": ["full_attention"]})
    _raises("sliding_window", config_from_hf, {**d, "sliding_window": 0})
    _raises("rope_type", config_from_hf, {**d, "rope_parameters": {"rope_type": "llama3"}})
    _raises("quant_method", config_from_hf, {**d, "quantization_config": {"quant_method": "fp8"}})
    _, vocab, max_seq, _ = config_from_hf(d)
    for field, value in (
        ("softmax_type", "vanilla"),
        ("glu_linear_offset", 0.0),
        ("activation_func_clamp_value", None),
        ("qk_layernorm", True),
        ("moe_shared_expert_intermediate_size", 16),
        ("moe_router_pre_softmax", True),
    ):
        bad, *_ = config_from_hf(d, **{field: value})
        _raises(field, config_to_hf, bad, vocab, max_seq)
    dense, *_ = config_from_hf(d, num_moe_experts=None)
    _raises("every layer MoE", config_to_hf_dict, dense, vocab, max_seq)


# ---- MXFP4 ------------------------------------------------------------------------------


def _random_mxfp4(shape, generator):
    """uint8 blocks `[*shape[:-1], shape[-1] / 32, 16]` and scales 2^-7 .. 2^-3."""
    *lead, cols = shape
    blocks = torch.randint(0, 256, (*lead, cols // 32, 16), generator=generator)
    scales = torch.randint(120, 125, (*lead, cols // 32), generator=generator)
    return blocks.to(torch.uint8), scales.to(torch.uint8)


def test_mxfp4_dequantisation_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks, scales = _random_mxfp4((3, 10, 64), g)
    blocks[0, 0, 0, :8] = torch.tensor([0x00, 0x08, 0x17, 0x7F, 0xF8, 0x81, 0x4C, 0xFF])
    scales[0, 0, 0] = 127  # those codes unscaled: every E2M1 value appears
    ours = dequantize_mxfp4(blocks, scales)  # [E, out, in]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(ours, theirs.transpose(1, 2))
    # by hand from the format: low nibble first; 0x17 -> code 7 (6.0), code 1 (0.5); ...
    want = [0, 0, -0, 0, 6, 0.5, -6, 6, -0, -6, 0.5, -0, -2, 2, -6, -6]
    assert ours[0, 0, :16].tolist() == want
    with pytest.raises(ValueError, match=r"blocks .* and scales .*the rule"):
        dequantize_mxfp4(blocks[..., :8], scales)


def _mxfp4_model_and_files(path, hf_case="alternating-yarn"):
    """A gpt-oss HF model whose experts hold dequantised MXFP4 values, and a checkpoint
    directory storing those experts as OpenAI's release does (blocks + scales)."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = hf_model(hf_case, intermediate_size=64)  # F = 64: down's rows in 2 blocks of 32
    g = torch.Generator().manual_seed(5)
    files = dict(hf.state_dict())
    for i, layer in enumerate(hf.model.layers):
        experts, pre = layer.mlp.experts, f"model.layers.{i}.mlp.experts."
        for name, (rows, cols) in (("gate_up_proj", (128, 32)), ("down_proj", (32, 64))):
            blocks, scales = _random_mxfp4((4, rows, cols), g)
            with torch.no_grad():
                getattr(experts, name).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                )
            del files[pre + name]
            files[pre + name + "_blocks"], files[pre + name + "_scales"] = blocks, scales
    path.mkdir()
    save_file({k: v.contiguous() for k, v in files.items()}, str(path / "model.safetensors"))
    config = {**hf.config.to_dict(), "quantization_config": {"quant_method": "mxfp4"}}
    (path / "config.json").write_text(json.dumps(config))
    return hf


# (tp, pp, ep, etp) -> the sizes a rank of that layout reads; etp 4 splits F=64 into 16s,
# which MXFP4's blocks of 32 cannot: down's rows are read whole and sliced
SHARD_LAYOUTS = [(2, 1, 1, None), (1, 2, 2, None), (2, 1, 2, 1), (1, 1, 1, 4), (2, 2, 2, 2)]


@pytest.mark.parametrize("layout", SHARD_LAYOUTS, ids=lambda x: "tp{}-pp{}-ep{}-etp{}".format(*x))
def test_mxfp4_and_plain_checkpoints_give_every_rank_its_shard(tmp_path, layout):
    """Both forms on disk, read by slices for every rank of the layout, equal the shards of
    the single-process model (bitwise), whose logits are transformers' (MXFP4 values)."""
    from pentatron.models.hf import load_hf_checkpoint_shard

    hf = _mxfp4_model_and_files(tmp_path / "mxfp4")
    hf.save_pretrained(tmp_path / "plain")
    single = load_hf_checkpoint_shard(tmp_path / "mxfp4").eval()
    torch.testing.assert_close(_logits(single), _hf_logits(hf), **TOL)
    full = single.state_dict()
    assert all(torch.equal(t, from_hf(hf).state_dict()[n]) for n, t in full.items())
    tp, pp, ep, etp = layout
    config, vocab, _, _ = config_from_hf(
        hf.config,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        sequence_parallel=tp > 1,  # MoE at tp > 1 needs it
    )
    etp = config.expert_tp_size
    for form in ("mxfp4", "plain"):
        with SafetensorsDirSource(tmp_path / form) as src:
            for t, p, e, q in _ranks(tp, pp, ep, etp):
                sd = hf_shard_state_dict(
                    src, config, vocab, tp_rank=t, pp_rank=p, ep_rank=e, etp_rank=q
                )
                offset = p * config.num_layers // pp
                for local, got in sd.items():
                    want = shard_full_tensor(
                        local,
                        full[global_param_name(local, offset)],
                        t,
                        tp,
                        config=config,
                        padded_vocab_size=pad_vocab_size(vocab, tp, 128),
                        ep_rank=e,
                        ep_size=ep,
                        etp_rank=q,
                        etp_size=etp,
                    )
                    assert torch.equal(got, want), (form, t, p, e, q, local)


def _ranks(tp, pp, ep, etp):
    return [(t, p, e, t % etp) for t in range(tp) for p in range(pp) for e in range(ep)] + [
        (0, 0, e, q) for e in range(ep) for q in range(etp)
    ]


# ---- on gloo ranks, and the CLI ----------------------------------------------------------


def _rank_forward(path):
    from pentatron.models.hf import load_hf_checkpoint_shard

    grid = init_grid(ParallelConfig(tp=2, ep=2))
    try:
        model = load_hf_checkpoint_shard(path, grid, sequence_parallel=True).eval()
        with torch.no_grad():
            logits = model(_ids(), None, gather_logits=True)[..., :V]
        return {"logits": logits, "hf": to_hf(model), "tp": grid.rank("tp"), "ep": grid.rank("ep")}
    finally:
        destroy_model_parallel(grid)


def test_tp2_ep2_sp_model_gives_transformers_logits(distributed, tmp_path):
    """Each rank loads only its heads' sinks, q/k/v rows and experts (MXFP4 on disk); the
    sharded model's logits equal transformers', and `to_hf` gathers the HF state dict."""
    hf = _mxfp4_model_and_files(tmp_path / "ckpt")
    want = _hf_logits(hf)
    results = distributed.run(4, _rank_forward, str(tmp_path / "ckpt"))
    assert sorted((r["tp"], r["ep"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    ref = hf.state_dict()
    for res in results:
        torch.testing.assert_close(res["logits"], want, **TOL)
        assert set(res["hf"]) == set(ref)
        for name, t in ref.items():
            assert torch.equal(res["hf"][name], t), name


def test_cli_round_trip_tp2_pp2_ep2(tmp_path):
    """HF -> Pentatron (tp2 pp2 ep2) -> HF: every tensor back, bit for bit, loadable by
    `from_pretrained`."""
    from pentatron.models.hf.cli import main

    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    ckpt, back = tmp_path / "pt", tmp_path / "back"
    sizes = ["--tp", "2", "--pp", "2", "--ep", "2"]
    assert main(["hf-to-pentatron", "--hf", str(tmp_path / "hf"), "--out", str(ckpt), *sizes]) == 0
    assert main(["pentatron-to-hf", "--ckpt", str(ckpt), "--out", str(back)]) == 0
    again = transformers.GptOssForCausalLM.from_pretrained(back).eval()
    ref, got = hf.state_dict(), again.state_dict()
    assert set(ref) == set(got)
    for name, t in ref.items():
        assert torch.equal(got[name], t), name
