"""Hugging Face DeepSeek-V3 in and out (`from_hf`, `to_hf`, the sharded load, the CLI).

- Logits: our model imported from a transformers `DeepseekV3ForCausalLM` (MLA with and
  without the q latent, YaRN, a first dense layer, 4 routed experts in 2 groups with
  sigmoid scores and a random score-correction bias, a shared expert, routed scaling
  2.5) equal its logits, fp32, max|diff| <= 1e-4 of max|logit|.
- Export -> import: `to_hf` gives back every HF tensor bit for bit, and the config round
  trips; with an MTP depth (DeepSeek's `model.layers.{L}` tensors, written by hand here
  where transformers has no module for them) import -> export is bitwise too.
- Sharded: at tp2-pp2-ep2 (world 8) every rank's `load_hf_checkpoint_shard` equals the
  shard of the single-process model, and the CLI round trip HF -> checkpoint -> HF is
  bitwise.
- Bad input fails naming the HF field.
"""

from __future__ import annotations

import pytest
import torch

from pentatron.models import global_param_name, shard_full_tensor
from pentatron.models.hf import HFConfigError, config_from_hf, config_to_hf_dict, from_hf, to_hf
from pentatron.parallel_state import (
    ParallelConfig,
    destroy_model_parallel,
    initialize_model_parallel,
)

V, S = 96, 16
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _config(q_lora_rank=16, rope=None, **kw):
    transformers = pytest.importorskip("transformers")
    fields = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        max_position_embeddings=S,
        tie_word_embeddings=False,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
    )
    fields.update(kw)
    return transformers.DeepseekV3Config(**fields)


def _hf_model(seed=0, **kw):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(_config(**kw)).float().eval()
    with torch.no_grad():  # norms away from 1, a bias that changes the routing
        for name, t in model.state_dict().items():
            if "norm" in name:
                t.add_(torch.randn_like(t) * 0.3)
            elif "e_score_correction_bias" in name:
                t.copy_(torch.randn_like(t))
            elif name.endswith("weight"):
                t.normal_(0.0, 0.2)
    return model


def _ids():
    return torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(3))


def _rel(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize(
    "kw", [{}, {"q_lora_rank": None}, {"rope": YARN}], ids=["q-lora", "q-direct", "yarn"]
)
def test_logits_match_transformers(kw):
    hf = _hf_model(**kw)
    ours = from_hf(hf, make_vocab_size_divisible_by=1).eval()
    assert ours.config.multi_latent_attention and ours.config.moe_router_enable_expert_bias
    assert ours.config.moe_layer_pattern() == [False, True, True, True]
    with torch.no_grad():
        want = hf(input_ids=_ids()).logits
        got = ours(_ids(), None)[..., :V]
    assert _rel(got, want) <= 1e-4, _rel(got, want)


def test_the_correction_bias_matters():
    """The comparison sees the routing: a zeroed correction bias moves the logits by more
    than ten times the tolerance."""
    hf = _hf_model()
    ours = from_hf(hf, make_vocab_size_divisible_by=1).eval()
    with torch.no_grad():
        want = hf(input_ids=_ids()).logits
        for name, buf in ours.named_buffers():
            if name.endswith("expert_bias"):
                buf.zero_()
        assert _rel(ours(_ids(), None)[..., :V], want) > 1e-3


def test_export_import_round_trips_bitwise():
    hf = _hf_model()
    ours = from_hf(hf, make_vocab_size_divisible_by=1)
    exported = to_hf(ours)
    ref = hf.state_dict()
    assert set(exported) == set(ref)
    for name, t in ref.items():
        assert torch.equal(exported[name], t), name
    config, vocab, seq, extras = config_from_hf(hf.config)
    d = config_to_hf_dict(config, vocab, seq, extras)
    again, _, _, _ = config_from_hf(d)
    assert again == config
    assert d["first_k_dense_replace"] == 1 and d["n_shared_experts"] == 1 and d["n_group"] == 2


def _with_mtp(hf) -> dict[str, torch.Tensor]:
    """DeepSeek's release layout of one MTP depth after `hf`'s layers (written by hand:
    transformers builds no module for it): a MoE layer plus enorm / hnorm / eh_proj /
    shared_head.norm and the copies of the embedding and head."""
    state = dict(hf.state_dict())
    L, h = hf.config.num_hidden_layers, hf.config.hidden_size
    g = torch.Generator().manual_seed(7)
    for name, t in list(state.items()):
        if name.startswith(f"model.layers.{L - 1}."):
            state[name.replace(f"layers.{L - 1}.", f"layers.{L}.")] = t + 0.01 * torch.randn(
                t.shape, generator=g
            )
    pre = f"model.layers.{L}."
    state[pre + "enorm.weight"] = 1 + 0.3 * torch.randn(h, generator=g)
    state[pre + "hnorm.weight"] = 1 + 0.3 * torch.randn(h, generator=g)
    state[pre + "eh_proj.weight"] = 0.2 * torch.randn(h, 2 * h, generator=g)
    state[pre + "shared_head.norm.weight"] = 1 + 0.3 * torch.randn(h, generator=g)
    state[pre + "embed_tokens.weight"] = state["model.embed_tokens.weight"]
    state[pre + "shared_head.head.weight"] = state["lm_head.weight"]
    return state


def test_mtp_layers_import_and_export_bitwise():
    hf = _hf_model()
    state = _with_mtp(hf)
    ours = from_hf(state, hf.config, make_vocab_size_divisible_by=1, mtp_num_layers=1)
    assert ours.config.is_moe_layer(ours.config.num_layers + 1)
    enorm = ours.mtp.layers[0].enorm.weight
    assert torch.equal(enorm, state["model.layers.4.enorm.weight"])
    exported = to_hf(ours)
    assert set(exported) == set(state)
    for name, t in state.items():
        assert torch.equal(exported[name], t), name
    assert config_to_hf_dict(ours.config, V, S)["num_nextn_predict_layers"] == 1


# --- sharded load at tp2-pp2-ep2 ---------------------------------------------------------------


def _rank_load(path: str):
    from pentatron.models.hf import load_hf_checkpoint_shard

    grid = initialize_model_parallel(ParallelConfig(tp=2, pp=2, ep=2))
    try:
        model = load_hf_checkpoint_shard(
            path, grid, make_vocab_size_divisible_by=1, sequence_parallel=True
        )
        return {
            "sd": {k: v.clone() for k, v in model.state_dict().items()},
            "ranks": {n: grid.rank(n) for n in ("tp", "ep", "etp")},
            "sizes": {n: grid.size(n) for n in ("tp", "ep", "etp")},
            "offset": model.layer_offset,
            "padded": model.padded_vocab_size,
            "hf": to_hf(model, gather_pipeline=True),
        }
    finally:
        destroy_model_parallel(grid)


def test_sharded_load_tp2_pp2_ep2_gives_each_rank_its_shard(distributed, tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    single = from_hf(hf, make_vocab_size_divisible_by=1)
    full, config = single.state_dict(), single.config
    ref = hf.state_dict()
    for res in distributed.run(8, _rank_load, str(tmp_path)):
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
            assert torch.equal(t, want), local
        assert set(res["hf"]) == set(ref)
        for name, t in ref.items():
            assert torch.equal(res["hf"][name], t), name


def test_cli_round_trip_tp2_pp2_ep2(tmp_path):
    from pentatron.models.hf.cli import main

    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    ckpt, back = tmp_path / "pt", tmp_path / "back"
    sizes = ["--tp", "2", "--pp", "2", "--ep", "2"]
    assert main(["hf-to-pentatron", "--hf", str(tmp_path / "hf"), "--out", str(ckpt), *sizes]) == 0
    assert main(["pentatron-to-hf", "--ckpt", str(ckpt), "--out", str(back)]) == 0
    again = type(hf).from_pretrained(back).eval()
    ref, got = hf.state_dict(), again.state_dict()
    assert set(ref) == set(got)
    for name, t in ref.items():
        assert torch.equal(got[name], t), name


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"rope_interleave": False}, "rope_interleave"),
        ({"rms_norm_eps": 1e-5}, "rms_norm_eps"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"n_routed_experts": 8, "n_group": 4, "topk_group": 2}, "topk_group"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_unrepresentable_configs_fail_naming_the_field(change, field):
    d = {**_config().to_dict(), **change}
    with pytest.raises(HFConfigError, match=field):
        config_from_hf(d)
