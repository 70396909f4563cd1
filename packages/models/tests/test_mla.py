"""Multi-latent attention (`multi_latent_attention=True`, MLASelfAttention).

- Independent reference: transformers' DeepseekV3ForCausalLM (all layers dense, DeepSeek's
  interleaved RoPE, with and without q compression), given our weights: loss, logits and
  every parameter's gradient, fp32, max|diff| <= 1e-5 max|ref| per tensor.
- Parallel parity: tp2, tp2+SP, tp4+SP, pp2, tp2-pp2-vpp2+SP against one process of our own
  model (the reference above vouches for it): per-token losses and every gradient, fp32,
  rtol 1e-5 / atol 1e-6. A missing tp sum of k_pe's gradient (every rank's heads share it)
  fails these; `test_k_pe_gradient_sum_is_needed` plants it.
- Context parallelism: cp2-tp2+SP with each cp_comm_type gives one process's losses and
  gradients (V zero-padded to q/k's head dim for the cp kernels).
- Communication: the down-projections are duplicated over tp (Megatron's TE layout), so the
  block never gathers the hidden states (collectives counted at tp2 with and without SP),
  and latent ranks tp does not divide work (parity at tp4+SP).
- Bad input: MLA with non-RoPE positions, a YaRN factor below 1, a row-split down-projection,
  or the standard spec, fails naming the field.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _gpt import MLA, TOL, VOCAB, B, S, microbatches, reference_run, small_config
from test_parity import _all_layouts, _merged_grads, assert_matches_reference

from pentatron.models import (
    GPTModel,
    ModelConfigError,
    get_gpt_layer_local_spec,
    mla,
)
from pentatron.tp_layers import ColumnParallelLinear

LAYOUTS = [  # (tp, pp, vpp, sequence_parallel, tied, spec)
    (2, 1, None, False, True, "mla"),
    (2, 1, None, True, True, "mla"),
    (4, 1, None, True, False, "mla"),
    (1, 2, None, False, True, "mla"),
    (2, 2, 2, True, True, "mla"),
]


def _config(**kw):
    return small_config(**{**MLA, "num_query_groups": 8, **kw})


# ---- against transformers ----------------------------------------------------------------


def _to_deepseek(state: dict[str, torch.Tensor], q_lora: bool) -> dict[str, torch.Tensor]:
    """Our (tied, bias-free) state dict -> DeepseekV3ForCausalLM names, written out here."""
    attn = {
        "linear_q_proj": "q_proj",
        "linear_q_down_proj": "q_a_proj",
        "q_layernorm": "q_a_layernorm",
        "linear_q_up_proj": "q_b_proj",
        "linear_kv_down_proj": "kv_a_proj_with_mqa",
        "kv_layernorm": "kv_a_layernorm",
        "linear_kv_up_proj": "kv_b_proj",
        "linear_proj": "o_proj",
    }
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"][:VOCAB]}
    out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = out["model.embed_tokens.weight"]
    for name, t in state.items():
        if not name.startswith("decoder.layers."):
            continue
        _, _, i, part, rest = name.split(".", 4)
        pre = f"model.layers.{i}."
        if part == "self_attention":
            module = rest.split(".")[0]
            out[pre + "self_attn." + attn[module] + ".weight"] = t
        elif part == "input_layernorm":
            out[pre + "input_layernorm.weight"] = t
        elif part == "pre_mlp_layernorm":
            out[pre + "post_attention_layernorm.weight"] = t
        elif rest == "linear_fc1.weight":
            gate, up = t.chunk(2, dim=0)
            out[pre + "mlp.gate_proj.weight"], out[pre + "mlp.up_proj.weight"] = gate, up
        elif rest == "linear_fc2.weight":
            out[pre + "mlp.down_proj.weight"] = t
    return out


# YaRN: (factor, mscale, mscale_all_dim) over an original context of 8 (s = 16)
YARN = {"none": None, "yarn": (4.0, 1.0, 1.0), "yarn-mscale": (4.0, 0.8, 1.0)}


@pytest.mark.parametrize(
    ("q_lora_rank", "yarn"),
    [(16, "none"), (None, "none"), (16, "yarn"), (None, "yarn-mscale")],
    ids=["q-lora", "q-direct", "q-lora-yarn", "q-direct-yarn-mscale"],
)
def test_matches_transformers_deepseek_v3(q_lora_rank, yarn):
    transformers = pytest.importorskip("transformers")
    rope: dict = {"rope_type": "default", "rope_theta": 10000.0}
    scaling: dict = {}
    if YARN[yarn] is not None:
        factor, mscale, mscale_all_dim = YARN[yarn]
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor}
        rope |= {"original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0}
        rope |= {"mscale": mscale, "mscale_all_dim": mscale_all_dim}
        scaling = dict(
            rotary_scaling_factor=factor,
            mscale=mscale,
            mscale_all_dim=mscale_all_dim,
            yarn_original_max_position_embeddings=8,
        )
    config = _config(
        q_lora_rank=q_lora_rank,
        add_bias_linear=False,
        init_method_std=0.02,
        layernorm_epsilon=1e-6,  # transformers' latent norms have eps 1e-6 whatever the config
        **scaling,
    )
    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True)
    # no padded rows: their logits would enter our softmax, not transformers'
    ours = GPTModel(config, spec, VOCAB, 16, make_vocab_size_divisible_by=4)
    with torch.no_grad():  # norms away from 1, so a dropped or misplaced norm shows
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    hf_config = transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_head_dim,
        qk_rope_head_dim=config.qk_pos_emb_head_dim,
        v_head_dim=config.v_head_dim,
        first_k_dense_replace=config.num_layers,  # every layer dense
        rope_interleave=True,
        rms_norm_eps=config.layernorm_epsilon,
        attention_bias=False,
        tie_word_embeddings=True,
        max_position_embeddings=16,
        rope_parameters=rope,
    )
    hf = transformers.DeepseekV3ForCausalLM(hf_config).float()
    hf.load_state_dict(_to_deepseek(ours.state_dict(), q_lora_rank is not None), strict=True)
    ids, pos, labels = microbatches(1)[0]
    loss = ours(ids, pos, labels=labels).mean()
    loss.backward()
    logits = hf(input_ids=ids).logits
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    _assert_close_to_max(ours(ids, pos).detach(), logits.detach(), "logits")
    ours_grads = _to_deepseek({n: p.grad for n, p in ours.named_parameters()}, True)
    for name, p in hf.named_parameters():
        _assert_close_to_max(ours_grads[name], p.grad, name)


def _assert_close_to_max(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """fp32 sums in another order: max|diff| <= 1e-5 of the tensor's largest entry
    (measured: 1.1e-6 at most)."""
    err = (got - want).abs().max() / want.abs().max()
    assert err <= 1e-5, f"{what}: max|diff| / max|ref| = {err:.2e}"


# ---- parallel parity -------------------------------------------------------------------


@pytest.fixture(scope="module")
def mla_parity(distributed):
    out = {}
    for q_lora_rank in (16, None):
        base, data = _config(q_lora_rank=q_lora_rank), microbatches()
        refs = {
            tied: reference_run(
                dataclasses.replace(base, untie_embeddings_and_output_weights=not tied), data
            )
            for tied in (True, False)
        }
        states = {tied: ref[0] for tied, ref in refs.items()}
        per_rank = distributed.run(4, _all_layouts, base, LAYOUTS, states, data)
        results = {lay: [r[i] for r in per_rank] for i, lay in enumerate(LAYOUTS)}
        out[q_lora_rank] = (base, refs, results)
    return out


@pytest.mark.parametrize("q_lora_rank", [16, None], ids=["q-lora", "q-direct"])
@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda lay: "tp{}-pp{}-vpp{}-sp{}-tied{}".format(*lay[:5])
)
def test_losses_and_grads_match_single_process(mla_parity, layout, q_lora_rank):
    base, refs, results = mla_parity[q_lora_rank]
    _, ref_losses, ref_grads = refs[layout[4]]
    grads = assert_matches_reference(base, results[layout], layout, ref_losses, ref_grads)
    assert any("linear_kv_down_proj" in n for n in grads)  # the MLA layers were compared


def _without_k_pe_sum(base, layouts, states, data):
    kept = mla.copy_to_tensor_model_parallel_region
    mla.copy_to_tensor_model_parallel_region = lambda x, group=None: x  # the planted bug
    try:
        return _all_layouts(base, layouts, states, data)
    finally:
        mla.copy_to_tensor_model_parallel_region = kept


def test_k_pe_gradient_sum_is_needed(distributed):
    """Planted: k_pe's gradient not summed over tp -> the kv down-projection's k_pe rows
    get only one rank's heads' share: parity fails on that weight in every layer."""
    base, data = _config(), microbatches()
    state, _, ref_grads = reference_run(base, data)
    layout = (2, 1, None, False, True, "mla")
    per_rank = distributed.run(2, _without_k_pe_sum, base, [layout], {True: state}, data)
    grads = _merged_grads([r[0] for r in per_rank], base)
    wrong = {n for n, want in ref_grads.items() if not torch.allclose(grads[n], want, **TOL)}
    for i in range(base.num_layers):  # then everything upstream of them, through dX
        assert f"decoder.layers.{i}.self_attention.linear_kv_down_proj.weight" in wrong


# ---- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"position_embedding_type": "learned_absolute"}, "position_embedding_type"),
        ({"rotary_scaling_factor": 0.5}, "rotary_scaling_factor"),
    ],
)
def test_unsupported_combinations_fail_naming_the_field(overrides, field):
    with pytest.raises(ModelConfigError, match=field):
        _config(**overrides)


def test_latent_ranks_need_not_divide_by_tp(distributed):
    """Nothing splits the down-projections: q_lora_rank 18 and kv_lora_rank 10 at tp4+SP
    (which row-split down-projections would refuse) give one process's losses and grads."""
    base, data = _config(q_lora_rank=18, kv_lora_rank=10), microbatches()
    state, ref_losses, ref_grads = reference_run(base, data)
    layout = (4, 1, None, True, True, "mla")
    per_rank = distributed.run(4, _all_layouts, base, [layout], {True: state}, data)
    assert_matches_reference(base, [r[0] for r in per_rank], layout, ref_losses, ref_grads)


def test_a_row_split_down_projection_is_refused():
    spec = get_gpt_layer_local_spec(True, True)
    spec.submodules.self_attention.submodules.linear_kv_down_proj = ColumnParallelLinear
    with pytest.raises(ModelConfigError, match=r"linear_kv_down_proj=ColumnParallelLinear.*fix"):
        GPTModel(_config(), spec, VOCAB, 16)


def test_the_standard_spec_refuses_an_mla_config():
    with pytest.raises(ModelConfigError, match="multi_latent_attention=True"):
        GPTModel(_config(), get_gpt_layer_local_spec(), VOCAB, 16)


def test_mla_up_proj_recompute_keeps_parity_under_tp_sp_and_pipeline(distributed):
    """Recomputing the up-projections in backward re-runs their sequence all-gathers there:
    tp2+SP and tp2-pp2-vpp2+SP still give the single-process losses and gradients."""
    base = _config(recompute_granularity="selective", recompute_modules=["mla_up_proj"])
    data = microbatches()
    state, ref_losses, ref_grads = reference_run(base, data)
    layouts = [(2, 1, None, True, True, "mla"), (2, 2, 2, True, True, "mla")]
    per_rank = distributed.run(4, _all_layouts, base, layouts, {True: state}, data)
    for i, layout in enumerate(layouts):
        results = [r[i] for r in per_rank]
        assert_matches_reference(base, results, layout, ref_losses, ref_grads)


# ---- context parallelism -----------------------------------------------------------------------

CP_KINDS = ("p2p", "all_gather", "a2a")


def _mla_cp_cases(state, data):
    """MLA GPT at cp2-tp2 with SP, each cp_comm_type: per-token loss shard and grads
    (summed over cp: each cp rank saw its tokens only)."""
    from pentatron.models import load_full_state_dict, sync_grads
    from pentatron.models.context_parallel import shard_for_cp_rank
    from pentatron.parallel_state import (
        ParallelConfig,
        comm,
        destroy_model_parallel,
        initialize_model_parallel,
    )

    out = {}
    grid = initialize_model_parallel(ParallelConfig(tp=2, cp=2))
    try:
        for kind in CP_KINDS:
            config = _config(
                tensor_model_parallel_size=2,
                sequence_parallel=True,
                context_parallel_size=2,
                cp_comm_type=kind,
            )
            spec = get_gpt_layer_local_spec(multi_latent_attention=True)
            model = GPTModel(config, spec, VOCAB, 16, grid=grid, make_vocab_size_divisible_by=32)
            load_full_state_dict(model, state)
            ids, pos, labels = (shard_for_cp_rank(x, 2, grid.rank("cp")) for x in data)
            loss = model(ids, pos, labels=labels)
            loss.sum().backward()
            sync_grads(model)
            grads = {}
            for name, p in model.named_parameters():
                g = p.grad.clone()
                comm.all_reduce(g, group=grid.group("cp"))
                grads[name] = g
            out[kind] = (loss.detach(), grads, grid.rank("tp"), grid.rank("cp"))
    finally:
        destroy_model_parallel(grid)
    return out


@pytest.fixture(scope="module")
def mla_cp(distributed):
    from _gpt import build_reference

    model = build_reference(_config())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = microbatches(1)[0]
    loss = model(*data[:2], labels=data[2])
    loss.sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, distributed.run(4, _mla_cp_cases, state, data)


@pytest.mark.parametrize("kind", CP_KINDS)
def test_cp2_tp2_sp_matches_one_process(mla_cp, kind):
    """V (d_v = 6) travels zero-padded to q/k's 12 dims: losses and every gradient equal
    one process's (the tolerances of the standard-attention cp test)."""
    from pentatron.models import merge_shards
    from pentatron.models.context_parallel import gather_cp_shards

    ref_loss, ref_grads, per_rank = mla_cp
    results = [r[kind] for r in per_rank]
    by_cp = {cp: next(r for r in results if r[3] == cp and r[2] == 0) for cp in (0, 1)}
    loss = gather_cp_shards([by_cp[0][0], by_cp[1][0]], dim=1)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    tp_ranks = sorted((r for r in results if r[3] == 0), key=lambda r: r[2])
    config = _config(tensor_model_parallel_size=2)
    assert any("linear_kv_up_proj" in n for n in ref_grads)
    for name, ref in ref_grads.items():
        got = merge_shards(name, [r[1][name] for r in tp_ranks], config=config)
        torch.testing.assert_close(got[: ref.size(0)], ref, rtol=1e-4, atol=1e-5, msg=name)


# ---- communication -----------------------------------------------------------------------


def _attention_collectives(sequence_parallel: bool) -> dict[str, list]:
    """One MLA block at tp2 (no RoPE: it adds no collective), forward then backward; the
    payload elements of each tp collective, by pass."""
    from pentatron.models.spec import build_module
    from pentatron.parallel_state import (
        ParallelConfig,
        comm,
        destroy_model_parallel,
        initialize_model_parallel,
    )

    grid = initialize_model_parallel(ParallelConfig(tp=2))
    try:
        config = _config(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
        spec = get_gpt_layer_local_spec(True, True).submodules.self_attention
        attn = build_module(spec, config, layer_number=1, tp_group=grid.group("tp"), tp_size=2)
        s = S // 2 if sequence_parallel else S
        x = torch.randn(s, B, config.hidden_size, requires_grad=True)
        with comm.trace() as forward:
            out, _ = attn(x)
        with comm.trace() as backward:
            out.square().sum().backward()
        return {
            name: sorted((r.op, r.elements) for r in ledger.records if r.group == "tp")
            for name, ledger in (("forward", forward), ("backward", backward))
        }
    finally:
        destroy_model_parallel(grid)


def _both(_=None):
    return {sp: _attention_collectives(sp) for sp in (True, False)}


def test_the_down_projections_communicate_no_hidden_states(distributed):
    """The duplicated down-projections need no collective: the block's tp traffic is k_pe,
    the two latents and linear_proj's, whose [s, b, h] reduce (and, under SP, its grad's
    all-gather) any attention has. Megatron's local spec (row-split down-projections) adds
    per layer two all-gathers of the hidden states under SP (two all-reduces of their
    grad without) and the latents' gathers over tp. Elements per rank's call, tp2."""
    c = _config()
    h, d_pe, r_q, r_kv = c.hidden_size, c.qk_pos_emb_head_dim, c.q_lora_rank, c.kv_lora_rank
    sb, sb_ = S * B, S // 2 * B  # full sequence, this rank's under SP
    got = distributed.run(2, _both)[0]
    assert got[True] == {
        "forward": sorted(
            [*(("all_gather", sb_ * n) for n in (d_pe, r_kv, r_q)), ("reduce_scatter", sb * h)]
        ),
        "backward": sorted(  # the latents gathered again for the up-projections' dW
            [("all_gather", sb_ * r_kv), ("all_gather", sb_ * r_q), ("all_gather", sb_ * h)]
            + [("reduce_scatter", sb * n) for n in (d_pe, r_kv, r_q)]
        ),
    }
    assert got[False] == {
        "forward": [("all_reduce", sb * h)],
        "backward": sorted(("all_reduce", sb * n) for n in (d_pe, r_kv, r_q)),
    }
