"""Backward against an independent reference: transformers' models, one process, fp32.

The parity tests compare our multi-rank GPT with our own GPTModel at size 1, so an error in
maths both share would cancel. Here the reference is Hugging Face's code: after one
forward + backward of the same batch, every parameter's grad of our model (shards gathered
to full tensors and renamed to HF names by the converter's own mapping, `to_hf`: a grad has
its weight's layout) must equal the HF model's `.grad`, per tensor
`max|ours - ref| / max|ref| <= 1e-5` (REL).

- dense: `LlamaForCausalLM` (4 layers, hidden 64, 4 heads / 2 kv heads, SwiGLU, RMSNorm,
  RoPE, untied) -> our GPT at tp2-pp2 with sequence parallelism (world 4, 1F1B, one
  micro-batch), loaded by `from_hf(grid=...)`;
- q/k norm: `Qwen3ForCausalLM` (Llama + per-head RMSNorm on q and k over head_dim, before
  RoPE), which our converter does not take: the test maps it (Llama tensors through
  `from_hf`, `q_norm` / `k_norm` to `q_layernorm` / `k_layernorm`) and compares one process
  and tp2-pp2-sp, where the q/k norm grads are tp-partial sums that `sync_grads` reduces;
- DeepSeek-V3: `DeepseekV3ForCausalLM` (multi-latent attention with a q latent, a dense
  first layer, then 4 experts top-2 in 2 groups with sigmoid scores, a random correction
  bias and a shared expert) at ep2-tp2 with sequence parallelism, as the MoE case below;
- MoE: `MixtralForCausalLM` (2 layers, 4 experts, top-2) -> our MoE GPT at ep2-tp2 with
  sequence parallelism (world 4, etp 2, dp 2: dp rank d trains on sample d; grads
  finalised like DDP: dense grads all-reduced over dp, expert grads over edp, both divided
  by dp). The load-balancing losses are off on both sides so the two losses are
  the same function: HF `router_aux_loss_coef=0`, `output_router_logits=False`; ours
  `moe_aux_loss_coeff=0`, no z-loss;
- Qwen2-MoE: `Qwen2MoeForCausalLM` (q/k/v biases, 4 experts top-2 softmax without
  renormalising the top-k, a shared expert behind a sigmoid gate) at ep2-tp2-sp, as above.

Loss: ours is the per-token cross-entropy `[b, s]` of logits at position t against
labels[t] (Megatron: labels come already shifted), averaged over the b*s tokens. HF gets
`shift_labels=labels` so its `ForCausalLMLoss` does not shift either, mean over the same
tokens. The vocabulary (128) is a multiple of `make_vocab_size_divisible_by * tp`: with
padding our softmax also runs over the padded (zero) logit columns (as Megatron's does),
which HF's does not have, and the losses would differ.

Measured 2026-12-05 (torch 2.13 CPU, transformers 5.25), worst rel error over the tensors:
dense tp2-pp2-sp 9.5e-7 (q_proj), q/k norm one process 6.3e-7 / tp2-pp2-sp 3.5e-6
(q_norm), MoE ep2-tp2-sp 8.8e-7; Qwen2-MoE ep2-tp2-sp 1.1e-6 (k_proj.bias, 2026-12-06;
with the shared-expert gate's sequence-parallel tag removed by hand, its two gate weights
fail at 0.89 and 1.05); tolerance 1e-5. A planted bug (the sequence-parallel
all-reduce of the norm grads dropped, `unittest.mock.patch` in the ranks) fails the
comparison on exactly the norm weights (worst 0.63). All ranks' runs happen in one
`distributed.run` on world 4.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch

from pentatron.models import (
    build_model_chunks,
    get_gpt_layer_local_spec,
    global_param_name,
    load_full_state_dict,
    merge_shards,
    sync_grads,
)
from pentatron.models.hf import from_hf, to_hf
from pentatron.models.hf.state_map import full_to_hf
from pentatron.parallel_state import (
    ParallelConfig,
    comm,
    destroy_model_parallel,
    initialize_model_parallel,
)
from pentatron.pipeline import PipelineConfig, get_forward_backward_func

transformers = pytest.importorskip("transformers")

V, B, S = 128, 2, 16
DIVISIBLE_BY = 32  # V = 128 is a multiple of 32 * tp: no padded vocabulary rows
REL = 1e-5
_COMMON = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": V,
    "max_position_embeddings": 32,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def _random(model):
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def hf_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**_COMMON, intermediate_size=96, num_hidden_layers=4)
    return _random(transformers.LlamaForCausalLM(config))


def hf_qwen3(layers=4):
    torch.manual_seed(1)
    config = transformers.Qwen3Config(
        **_COMMON, intermediate_size=96, num_hidden_layers=layers, head_dim=16
    )
    model = _random(transformers.Qwen3ForCausalLM(config))
    with torch.no_grad():  # norm weights near 1 (and distinct per channel), as trained ones
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(1.0)
    return model


def hf_deepseek_v3():
    """MLA (q latent), a dense first layer then MoE: 4 experts top-2 in 2 groups, sigmoid
    scores with a random correction bias, routed scaling 2.5, a shared expert."""
    torch.manual_seed(3)
    common = {**_COMMON, "num_key_value_heads": 4, "rms_norm_eps": 1e-6}
    config = transformers.DeepseekV3Config(
        **common,
        intermediate_size=96,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
    )
    model = _random(transformers.DeepseekV3ForCausalLM(config))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf))
    return model


def hf_mixtral():
    torch.manual_seed(2)
    config = transformers.MixtralConfig(
        **_COMMON,
        intermediate_size=32,
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.0,
        output_router_logits=False,
    )
    return _random(transformers.MixtralForCausalLM(config))


def hf_qwen2_moe():
    """Qwen2-MoE: q/k/v biases, 4 experts top-2 softmax without renormalising the top-k, a
    shared expert behind a sigmoid gate."""
    torch.manual_seed(4)
    config = transformers.Qwen2MoeConfig(
        **_COMMON,
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_hidden_layers=2,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        router_aux_loss_coef=0.0,
        output_router_logits=False,
    )
    return _random(transformers.Qwen2MoeForCausalLM(config))


def batch():
    """(input_ids, position_ids, labels), each `[b, s]`; labels independent of the ids."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    return ids, torch.arange(S).expand(B, S).contiguous(), labels


def hf_grads(hf) -> dict[str, torch.Tensor]:
    """Mean token cross-entropy, unshifted (see the module docstring), backward once."""
    hf.zero_grad(set_to_none=True)
    ids, _, labels = batch()
    hf(ids, labels=labels, shift_labels=labels).loss.backward()
    return {n: p.grad.detach().clone() for n, p in hf.named_parameters()}


def compare(got: dict, want: dict, rel: float = REL) -> dict[str, float]:
    """Per tensor max|got - want| / max|want|; AssertionError naming every tensor over
    `rel` (or missing / extra names, or a zero reference grad)."""
    assert set(got) == set(want), (sorted(set(got) ^ set(want)), "names differ")
    errors = {}
    for name, ref in want.items():
        scale = ref.abs().max().item()
        assert scale > 0, f"{name}: the reference grad is zero, the check would be vacuous"
        assert got[name].shape == ref.shape, (name, got[name].shape, ref.shape)
        errors[name] = (got[name] - ref).abs().max().item() / scale
    bad = {n: e for n, e in errors.items() if not e <= rel}
    assert not bad, f"grads differ from the reference beyond rel {rel}: {bad}"
    return errors


# --- the ranks -----------------------------------------------------------------------------
def _one_step(grid, model, ids, pos, labels):
    """One micro-batch through the 1F1B schedule (pp stages exchange `[s/t, b, h]`), then
    `sync_grads` (the tp all-reduce of the sequence-parallel / q/k norm grads)."""
    config = model.config

    def forward_step(data_iterator, chunk):
        return chunk(ids, pos, labels=labels), lambda out: (out.mean(), out.detach())

    get_forward_backward_func(config.pipeline_model_parallel_size, None)(
        forward_step_func=forward_step,
        data_iterator=iter([None]),
        model=model,
        num_microbatches=1,
        seq_length=S,
        micro_batch_size=B,
        config=PipelineConfig(
            hidden_size=config.hidden_size,
            sequence_parallel=config.sequence_parallel,
            finalize_model_grads_func=lambda chunks, tokens: sync_grads(chunks),
        ),
        grid=grid,
    )


@torch.no_grad()
def _grads_as_hf(model) -> dict[str, torch.Tensor]:
    """The converter's `to_hf` applied to the grads (copied into the weights: same layout)."""
    for p in model.parameters():
        p.copy_(p.grad)
    return to_hf(model)


def _llama_rank(state, hf_config, plant):
    grid = initialize_model_parallel(ParallelConfig(tp=2, pp=2))
    try:
        model = from_hf(
            state,
            hf_config,
            grid=grid,
            sequence_parallel=True,
            make_vocab_size_divisible_by=DIVISIBLE_BY,
        )
        planted = mock.patch(
            "pentatron.models.grads.sync_sequence_parallel_grads", lambda *a, **k: 0
        )
        with planted if plant else contextlib.nullcontext():
            _one_step(grid, model, *batch())
        return _grads_as_hf(model)
    finally:
        destroy_model_parallel(grid)


def _qk_rank(full_state, config):
    """Our model with q/k norm at tp2-pp2-sp from a full state dict; grads by global name."""
    grid = initialize_model_parallel(ParallelConfig(tp=2, pp=2))
    try:
        config = dataclasses.replace(
            config,
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            sequence_parallel=True,
        )
        (model,) = build_model_chunks(
            config,
            get_gpt_layer_local_spec(),
            V,
            S,
            grid,
            make_vocab_size_divisible_by=DIVISIBLE_BY,
        )
        load_full_state_dict(model, full_state)
        _one_step(grid, model, *batch())
        grads = {
            global_param_name(n, model.layer_offset): p.grad.clone()
            for n, p in model.named_parameters()
        }
        return {"tp_rank": grid.rank("tp"), "grads": grads}
    finally:
        destroy_model_parallel(grid)


def _moe_rank(state, hf_config):
    """ep2-tp2-sp (dp 2): dp rank d runs sample d; grads finalised like DDP (mean over dp)."""
    grid = initialize_model_parallel(ParallelConfig(tp=2, ep=2))
    try:
        model = from_hf(
            state,
            hf_config,
            grid=grid,
            sequence_parallel=True,
            moe_aux_loss_coeff=0.0,
            moe_z_loss_coeff=None,
            make_vocab_size_divisible_by=DIVISIBLE_BY,
        )
        ids, pos, labels = batch()
        d, dp = grid.rank("dp"), grid.size("dp")
        mine = slice(d * B // dp, (d + 1) * B // dp)
        model(ids[mine], pos[mine], labels=labels[mine]).mean().backward()
        sync_grads(model)
        for p in model.parameters():
            expert = not getattr(p, "allreduce", True)
            comm.all_reduce(p.grad, group=grid.group("edp" if expert else "dp-cp"))
            p.grad /= dp
        return _grads_as_hf(model)
    finally:
        destroy_model_parallel(grid)


def _world4(llama, qk, moe, deepseek, qwen2_moe):
    return {
        "llama": _llama_rank(*llama, plant=False),
        "llama-planted": _llama_rank(*llama, plant=True),
        "qk": _qk_rank(*qk),
        "moe": _moe_rank(*moe),
        "deepseek": _moe_rank(*deepseek),
        "qwen2_moe": _moe_rank(*qwen2_moe),
    }


# --- q/k norm: the Qwen3 <-> ours mapping, written here -------------------------------------
_QK = {"q_layernorm": "q_norm", "k_layernorm": "k_norm"}


def qwen3_as_ours(hf):
    """(our config with qk_layernorm, our full state dict) of a Qwen3ForCausalLM: the Llama
    tensors through `from_hf`, then each layer's q_norm / k_norm (`[head_dim]`)."""
    d = hf.config.to_dict()
    d.update(model_type="llama", sliding_window=None)
    state = {k: v for k, v in hf.state_dict().items() if "_norm." not in k}
    single = from_hf(state, d, make_vocab_size_divisible_by=DIVISIBLE_BY)
    config = dataclasses.replace(single.config, qk_layernorm=True)
    full = {k: v.clone() for k, v in single.state_dict().items()}
    for i in range(config.num_layers):
        for ours, theirs in _QK.items():
            full[f"decoder.layers.{i}.self_attention.{ours}.weight"] = hf.state_dict()[
                f"model.layers.{i}.self_attn.{theirs}.weight"
            ]
    return config, full


def ours_to_qwen3(full_grads: dict, config) -> dict[str, torch.Tensor]:
    """Full (global-named) grads -> Qwen3 names: q/k norms here, the rest by `full_to_hf`."""
    out, rest = {}, {}
    for name, g in full_grads.items():
        for ours, theirs in _QK.items():
            if name.endswith(f".self_attention.{ours}.weight"):
                i = name.split(".")[2]
                out[f"model.layers.{i}.self_attn.{theirs}.weight"] = g
                break
        else:
            rest[name] = g
    return {**out, **full_to_hf(rest, config, V)}


# --- the tests -------------------------------------------------------------------------------
def _merge(results: list[dict], strict: bool = True) -> dict[str, torch.Tensor]:
    """Union over pipeline stages of the per-rank HF dicts; `strict`: tp ranks must agree
    exactly (else the first rank's tensor is kept)."""
    merged: dict[str, torch.Tensor] = {}
    for res in results:
        for name, t in res.items():
            if name in merged:
                assert not strict or torch.equal(merged[name], t), name
                continue
            merged[name] = t
    return merged


@pytest.fixture(scope="module")
def world4(distributed):
    llama, qwen, mixtral, deepseek = hf_llama(), hf_qwen3(), hf_mixtral(), hf_deepseek_v3()
    qwen2_moe = hf_qwen2_moe()
    qk_config, qk_state = qwen3_as_ours(qwen)
    per_rank = distributed.run(
        4,
        _world4,
        (llama.state_dict(), llama.config.to_dict()),
        (qk_state, qk_config),
        (mixtral.state_dict(), mixtral.config.to_dict()),
        (deepseek.state_dict(), deepseek.config.to_dict()),
        (qwen2_moe.state_dict(), qwen2_moe.config.to_dict()),
    )
    refs = {"llama": hf_grads(llama), "qwen3": hf_grads(qwen), "mixtral": hf_grads(mixtral)}
    refs["deepseek"], refs["qwen2_moe"] = hf_grads(deepseek), hf_grads(qwen2_moe)
    return {**refs, "qk_config": qk_config}, per_rank


def test_llama_grads_tp2_pp2_sp_match_transformers(world4):
    refs, per_rank = world4
    errors = compare(_merge([r["llama"] for r in per_rank]), refs["llama"])
    assert max(errors.values()) > 0  # a parallel run is not bitwise the reference


def test_planted_backward_bug_fails_the_comparison(world4):
    """Without the sequence-parallel all-reduce each tp rank keeps its half of every norm
    weight's grad: the comparison must fail, and on exactly the norms."""
    refs, per_rank = world4
    got = _merge([r["llama-planted"] for r in per_rank], strict=False)
    with pytest.raises(AssertionError, match="grads differ") as err:
        compare(got, refs["llama"])
    named = {n for n in refs["llama"] if f"'{n}'" in str(err.value)}
    assert named == {n for n in refs["llama"] if "norm" in n}


def test_qk_layernorm_grads_tp2_pp2_sp_match_qwen3(world4):
    refs, per_rank = world4
    config = refs["qk_config"]
    by_name: dict[str, dict[int, torch.Tensor]] = {}
    for r in per_rank:
        for name, g in r["qk"]["grads"].items():
            by_name.setdefault(name, {})[r["qk"]["tp_rank"]] = g
    full = {
        n: merge_shards(n, [s[k] for k in sorted(s)], config=config) for n, s in by_name.items()
    }
    compare(ours_to_qwen3(full, config), refs["qwen3"])


def test_qk_layernorm_grads_one_process_match_qwen3():
    from pentatron.models import GPTModel

    hf = hf_qwen3(layers=2)
    config, full = qwen3_as_ours(hf)
    model = GPTModel(
        config, get_gpt_layer_local_spec(), V, S, make_vocab_size_divisible_by=DIVISIBLE_BY
    )
    model.load_state_dict(full)
    ids, pos, labels = batch()
    model(ids, pos, labels=labels).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert sum(n.endswith("q_layernorm.weight") for n in grads) == config.num_layers
    compare(ours_to_qwen3(grads, config), hf_grads(hf))


def test_mixtral_grads_ep2_tp2_sp_match_transformers(world4):
    refs, per_rank = world4
    for r in per_rank:  # one stage: every rank gathers the whole model (tp, etp, ep)
        compare(r["moe"], refs["mixtral"])


def test_deepseek_v3_grads_ep2_tp2_sp_match_transformers(world4):
    """MLA + grouped sigmoid routing with the correction bias + a shared expert, every
    gradient (the bias is a buffer: none) against DeepseekV3ForCausalLM's."""
    refs, per_rank = world4
    for r in per_rank:  # the export also carries the bias buffer: it has no gradient
        grads = {k: v for k, v in r["deepseek"].items() if "e_score_correction_bias" not in k}
        compare(grads, refs["deepseek"])


def test_qwen2_moe_grads_ep2_tp2_sp_match_transformers(world4):
    """q/k/v biases, softmax top-2 without renormalisation, the shared expert and its
    sigmoid gate: every gradient against Qwen2MoeForCausalLM's."""
    refs, per_rank = world4
    for r in per_rank:
        compare(r["qwen2_moe"], refs["qwen2_moe"])
