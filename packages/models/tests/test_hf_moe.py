"""Hugging Face Mixtral / Qwen2-MoE <-> GPTModel: config mapping, refusals, logits, round
trip, both expert layouts on disk, and the sharded load at ep / etp / tp / pp.

Reference: transformers' MixtralForCausalLM / Qwen2MoeForCausalLM with random weights
(std 0.2), eval mode (no jitter, no capacity dropping), fp32; logits within
atol=rtol=1e-4 on random tokens. Round trip: `to_hf(from_hf(m))` equals `m.state_dict()`
tensor by tensor (torch.equal); `to_hf(..., expert_layout="per_expert")` equals the files
`save_pretrained` writes. Sharded: every rank's state dict equals
`shard_full_tensor` of the single-process model's (exactly), each rank reads only its own
experts, and `to_hf(gather_pipeline=True)` gives the whole HF state dict on every rank.
One `distributed.run` per world size (2: ep2, pp2; 4: ep2 x tp2 + sequence parallel,
ep2 x pp2).
"""

from __future__ import annotations

import re

import pytest
import torch

from pentatron.models.hf import HFConfigError, config_from_hf, config_to_hf, from_hf, to_hf
from pentatron.models.sharding import global_param_name, shard_full_tensor
from pentatron.parallel_state import ParallelConfig, destroy_model_parallel
from pentatron.parallel_state import initialize_model_parallel as init_grid

transformers = pytest.importorskip("transformers")

V = 100
TOL = {"atol": 1e-4, "rtol": 1e-4}
_BASE = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": V,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
}
CASES = {
    "mixtral": ("MixtralForCausalLM", {"intermediate_size": 24, "num_local_experts": 4}),
    "mixtral-tied-e8": (
        "MixtralForCausalLM",
        {"intermediate_size": 16, "num_local_experts": 8, "tie_word_embeddings": True},
    ),
    "qwen-norm-false": (
        "Qwen2MoeForCausalLM",
        {
            "intermediate_size": 48,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24,
            "num_experts": 4,
            "mlp_only_layers": [1],
            "norm_topk_prob": False,
        },
    ),
    "qwen-norm-true-step2": (
        "Qwen2MoeForCausalLM",
        {
            "intermediate_size": 40,
            "moe_intermediate_size": 8,
            "shared_expert_intermediate_size": 16,
            "num_experts": 8,
            "decoder_sparse_step": 2,
            "norm_topk_prob": True,
            "qkv_bias": True,
        },
    ),
}


def hf_model(case: str, layers: int = 4, seed: int = 0):
    cls_name, kw = CASES[case]
    cls = getattr(transformers, cls_name)
    config_cls = cls.config_class
    config = config_cls(**{**_BASE, "num_hidden_layers": layers, "num_experts_per_tok": 2, **kw})
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _ids():
    return torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_and_round_trip(case):
    hf = hf_model(case)
    ours = from_hf(hf).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(_ids(), None)[..., :V], hf(_ids()).logits, **TOL)
    back, ref = to_hf(ours), hf.state_dict()
    assert set(back) == set(ref)
    for name, t in ref.items():
        assert torch.equal(back[name], t), name


def test_config_mapping_follows_hf_layers():
    hf = hf_model("qwen-norm-false")
    config, _, _, _ = config_from_hf(hf.config)
    moe_hf = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert config.moe_layer_pattern() == moe_hf == [True, False, True, True]
    assert config.moe_router_pre_softmax and config.add_qkv_bias and not config.add_bias_linear
    assert (config.num_moe_experts, config.moe_ffn_size, config.ffn_hidden_size) == (4, 16, 48)
    assert config.moe_shared_expert_intermediate_size == 24 and config.moe_shared_expert_gate
    step2, _, _, _ = config_from_hf(hf_model("qwen-norm-true-step2").config)
    assert step2.moe_layer_pattern() == [False, True, False, True]
    assert not step2.moe_router_pre_softmax
    mixtral, _, _, _ = config_from_hf(hf_model("mixtral").config)
    assert all(mixtral.moe_layer_pattern()) and not mixtral.moe_router_pre_softmax
    assert mixtral.moe_shared_expert_intermediate_size is None


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_to_hf_builds_the_same_model(case):
    """config -> HF config -> HF model: the same tensors (names, shapes), the same routing."""
    hf = hf_model(case)
    config, vocab, max_seq, extras = config_from_hf(hf.config)
    again = type(hf)(config_to_hf(config, vocab, max_seq, extras)).eval()
    again.load_state_dict(hf.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(again(_ids()).logits, hf(_ids()).logits, atol=0, rtol=0)
    config2, *_ = config_from_hf(again.config)
    assert config2 == config


@pytest.mark.parametrize("case", ["mixtral", "qwen-norm-false"])
def test_both_disk_layouts_load_and_per_expert_export_matches_files(tmp_path, case):
    from safetensors.torch import load_file

    from pentatron.models.hf import load_hf_checkpoint_shard

    hf = hf_model(case, layers=2)
    ours = from_hf(hf).eval()
    want = ours.state_dict()
    for sub, original in (("per_expert", True), ("fused", False)):
        hf.save_pretrained(tmp_path / sub, save_original_format=original)
        files = {}
        for f in (tmp_path / sub).glob("*.safetensors"):
            files.update(load_file(str(f)))
        experts = [k for k in files if ".experts." in k]
        fused = [k for k in experts if k.endswith("_proj")]
        assert bool(fused) == (not original) and experts  # the layout on disk is as named
        loaded = load_hf_checkpoint_shard(tmp_path / sub).state_dict()
        assert set(loaded) == set(want)
        for name, t in want.items():
            assert torch.equal(loaded[name], t), (sub, name)
        exported = to_hf(ours, expert_layout=sub)
        assert set(exported) == set(files)
        for name, t in files.items():
            assert torch.equal(exported[name], t), (sub, name)


def _raises(match, fn, *args, **kw):
    with pytest.raises(HFConfigError, match=match):
        fn(*args, **kw)


def test_bad_input_is_refused_with_the_field():
    mixtral = hf_model("mixtral", layers=2).config.to_dict()
    _raises("router_jitter_noise", config_from_hf, {**mixtral, "router_jitter_noise": 0.1})
    _raises("sliding_window", config_from_hf, {**mixtral, "sliding_window": 128})
    _raises("experts", config_from_hf, {**mixtral, "num_local_experts": 0})
    _raises("model_type", config_from_hf, {**mixtral, "model_type": "qwen3_moe"})
    qwen = hf_model("qwen-norm-false", layers=2).config.to_dict()
    _raises("use_sliding_window", config_from_hf, {**qwen, "use_sliding_window": True})
    _raises("shared_expert", config_from_hf, {**qwen, "shared_expert_intermediate_size": 0})
    _, vocab, max_seq, _ = config_from_hf(mixtral)
    for field, value in (
        ("moe_router_pre_softmax", True),
        ("moe_expert_capacity_factor", 1.0),
        ("moe_router_topk_scaling_factor", 2.0),
    ):
        bad, *_ = config_from_hf(mixtral, **{field: value})
        _raises(field, config_to_hf, bad, vocab, max_seq)
    sig, *_ = config_from_hf(
        qwen, moe_router_score_function="sigmoid", moe_router_pre_softmax=False
    )
    _raises("moe_router_score_function", config_to_hf, sig, vocab, max_seq)
    _raises(
        "expert_model_parallel_size",
        config_from_hf,
        {**mixtral, "model_type": "llama", "intermediate_size": 24},
        expert_model_parallel_size=2,
    )


# --- sharded load on gloo ranks ------------------------------------------------------------
LAYOUTS = {
    2: [("ep2", {"ep": 2}, {}), ("pp2", {"pp": 2}, {})],
    4: [
        ("ep2-tp2-sp", {"ep": 2, "tp": 2}, {"sequence_parallel": True}),
        ("ep2-pp2", {"ep": 2, "pp": 2}, {}),
    ],
}
CKPTS = {"mixtral": ("mixtral", True), "qwen": ("qwen-norm-false", False)}  # per-expert / fused


def _traced_reads(reads):
    from pentatron.models.hf import safetensors_io

    cls = safetensors_io.SafetensorsDirSource
    read, read_box = cls.read, cls.read_box

    def traced_read(self, name, dim=None, start=0, stop=None):
        reads.append((name, None if dim is None else (dim, start, stop)))
        return read(self, name, dim, start, stop)

    def traced_box(self, name, box):
        reads.append((name, ("box", *box)))
        return read_box(self, name, box)

    return cls, (read, read_box), (traced_read, traced_box)


def _rank_load(paths: dict, world: int):
    from pentatron.models.hf import load_hf_checkpoint_shard

    out = {}
    for layout, sizes, overrides in LAYOUTS[world]:
        grid = init_grid(ParallelConfig(**sizes))
        for ckpt, path in paths.items():
            reads: list = []
            cls, originals, traced = _traced_reads(reads)
            cls.read, cls.read_box = traced
            try:
                model = load_hf_checkpoint_shard(path, grid, **overrides)
            finally:
                cls.read, cls.read_box = originals
            out[(layout, ckpt)] = {
                "sd": {k: v.clone() for k, v in model.state_dict().items()},
                "ranks": {n: grid.rank(n) for n in ("tp", "pp", "ep", "etp")},
                "sizes": {n: grid.size(n) for n in ("tp", "ep", "etp")},
                "offset": model.layer_offset,
                "padded": model.padded_vocab_size,
                "reads": reads,
                "hf": to_hf(model, gather_pipeline=True),
            }
        destroy_model_parallel(grid)
    return out


@pytest.fixture(scope="module")
def sharded(distributed, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_moe")
    models, paths = {}, {}
    for ckpt, (case, original) in CKPTS.items():
        models[ckpt] = hf_model(case)
        paths[ckpt] = str(root / ckpt)
        models[ckpt].save_pretrained(paths[ckpt], save_original_format=original)
    results = {w: distributed.run(w, _rank_load, paths, w) for w in LAYOUTS}
    return models, results


def _experts_read(reads) -> set[int]:
    """Global expert ids this rank read (per-expert names, or the fused tensors' boxes)."""
    ids = set()
    for name, how in reads:
        m = re.search(r"\.experts\.(\d+)\.", name)
        if m:
            ids.add(int(m.group(1)))
        elif how is not None and how[0] == "box":
            ids.update(range(*how[1]))
    return ids


@pytest.mark.parametrize("ckpt", sorted(CKPTS))
@pytest.mark.parametrize("layout", [name for w in LAYOUTS for name, _, _ in LAYOUTS[w]])
def test_sharded_load_gives_each_rank_its_shard(sharded, layout, ckpt):
    models, results = sharded
    hf = models[ckpt]
    single = from_hf(hf)
    full, config = single.state_dict(), single.config
    world = next(w for w in LAYOUTS if layout in [n for n, _, _ in LAYOUTS[w]])
    ref_hf = hf.state_dict()
    for rank in results[world]:
        res = rank[(layout, ckpt)]
        r, s = res["ranks"], res["sizes"]
        for local, t in res["sd"].items():
            want = shard_full_tensor(
                local,
                full[global_param_name(local, res["offset"])],
                r["tp"],
                s["tp"],
                config=config,
                padded_vocab_size=res["padded"],
                ep_rank=r["ep"],
                ep_size=s["ep"],
                etp_rank=r["etp"],
                etp_size=s["etp"],
            )
            assert torch.equal(t, want), (layout, ckpt, local)
        per = config.num_moe_experts // s["ep"]
        assert _experts_read(res["reads"]) == set(range(r["ep"] * per, (r["ep"] + 1) * per))
        assert set(res["hf"]) == set(ref_hf)
        for name, t in ref_hf.items():
            assert torch.equal(res["hf"][name], t), (layout, ckpt, name)


@pytest.mark.parametrize("case", ["mixtral", "qwen-norm-false"])
def test_cli_round_trip_tp2_pp2_ep2(tmp_path, case):
    """HF -> Pentatron (tp2 pp2 ep2) -> HF: every tensor back, bit for bit; each rank file is
    `shard_full_tensor` of the single-process model."""
    from safetensors.torch import load_file

    from pentatron.models.hf.cli import main, rank_file

    hf = hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    ckpt, back = tmp_path / "pt", tmp_path / "back"
    sizes = ["--tp", "2", "--pp", "2", "--ep", "2"]
    assert main(["hf-to-pentatron", "--hf", str(tmp_path / "hf"), "--out", str(ckpt), *sizes]) == 0
    single = from_hf(hf)
    full = single.state_dict()
    for t, p, e in [(0, 0, 0), (1, 1, 1), (1, 0, 1)]:
        sd = load_file(str(ckpt / rank_file(t, p, e)))
        offset = 2 * p
        for local, got in sd.items():
            want = shard_full_tensor(
                local,
                full[global_param_name(local, offset)],
                t,
                2,
                config=single.config,
                padded_vocab_size=256,
                ep_rank=e,
                ep_size=2,
            )
            assert torch.equal(got, want), (t, p, e, local)
    assert main(["pentatron-to-hf", "--ckpt", str(ckpt), "--out", str(back)]) == 0
    again = type(hf).from_pretrained(back).eval()
    ref, got = hf.state_dict(), again.state_dict()
    assert set(ref) == set(got)
    for name, t in ref.items():
        assert torch.equal(got[name], t), name
