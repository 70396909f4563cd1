"""Acceptance: expert-parallel parity of a 2-layer MoE GPT (8 experts, top-2, SwiGLU with
biases, aux loss 1e-2 and z-loss 1e-3) on 4 gloo ranks against one process, fp32,
rtol 1e-5 / atol 1e-6: per-token losses, the per-layer aux and z losses the tracker
collects (`collect_moe_aux_losses`), and every gradient (tp/ep/etp shards merged).

ep is carved out of dp, so ranks of one ep group hold different micro-batches: dp rank d
trains on its own M micro-batches; the reference runs all dp ranks' micro-batches one
after another as separate micro-batches (aux losses are per micro-batch), with the loss
of each scaled by 1/(M dp) and the aux-loss grad scale 1/(M dp) - what the pipeline's
1/M plus DDP's mean over dp give. Distributed grads are finalized like DDP: dense grads
all-reduced over dp-cp, expert grads (`allreduce=False`) over edp, both divided by dp.

Layouts: ep in {1, 2, 4}, etp in {1, 2}, tp in {1, 2}, pp in {1, 2}, each dispatcher with
grouped-GEMM (really `torch._grouped_mm` on CPU fp32) and sequential experts, and shared
experts (gated) at tp2-sp-ep2 and pp2-ep2, and DeepSeek's kind (multi-latent attention with
a shared expert) at ep2 and tp2-sp-ep2; see LAYOUTS.

Capacity (factor 1.0, token dropping; the reference must drop > 0 assignments) is tested
at tp = 1 only: capacity is per rank over the tokens that rank routes (as Megatron), and
with tp > 1 + sequence parallelism each rank routes s/t tokens, so its drops differ from
one process routing all s. At tp = 1 every router sees the reference's token set (ep ranks
route their own micro-batches, pp stages the whole micro-batch), so dropping must match.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _gpt import DIVISIBLE_BY, MLA, TOL, VOCAB, B, S, microbatches
from _moe import moe_config, moe_spec

from pentatron.models import (
    GPTModel,
    build_model_chunks,
    global_param_name,
    load_full_state_dict,
    merge_shards,
    sync_grads,
)
from pentatron.models.moe.aux_tracker import collect_moe_aux_losses
from pentatron.models.moe.experts import GroupedMLP
from pentatron.models.moe.load_balancing import set_aux_loss_scale
from pentatron.models.moe.router import TopKRouter
from pentatron.parallel_state import (
    ParallelConfig,
    comm,
    destroy_model_parallel,
    initialize_model_parallel,
)
from pentatron.pipeline import PipelineConfig, get_forward_backward_func
from pentatron.tp_layers import model_parallel_seed

WORLD, M = 4, 2
LAYOUTS = [  # (tp, pp, ep, etp, dispatcher, grouped, capacity_factor, pad)
    (1, 1, 2, 1, "alltoall", False, None, False),
    (1, 1, 4, 1, "alltoall", False, None, False),
    (1, 1, 4, 1, "allgather", True, None, False),
    (1, 1, 2, 1, "allgather", False, None, False),
    (1, 1, 2, 2, "allgather", True, None, False),
    (2, 1, 2, 2, "alltoall", True, None, False),
    (2, 1, 2, 1, "alltoall", False, None, False),
    (2, 1, 1, 2, "allgather", False, None, False),
    (1, 2, 2, 1, "alltoall", True, None, False),
    (1, 2, 2, 1, "allgather", False, None, False),
    (2, 2, 1, 2, "alltoall", False, None, False),
    (2, 2, 2, 1, "allgather", True, None, False),
    # capacity 1.0 with dropping (tp = 1: see the module docstring)
    (1, 1, 2, 1, "alltoall", False, 1.0, False),
    (1, 1, 2, 1, "alltoall", True, 1.0, True),
    (1, 1, 2, 2, "alltoall", True, 1.0, False),
    (1, 1, 4, 1, "allgather", False, 1.0, False),
    (1, 1, 2, 1, "allgather", False, 1.0, True),
    (1, 2, 2, 1, "alltoall", False, 1.0, True),
    # shared experts (width 24, sigmoid gate) beside the routed ones: dense tp-sharded MLP
    (2, 1, 2, 1, "alltoall", True, None, False, 24),
    (1, 2, 2, 1, "allgather", False, None, False, 24),
    # DeepSeek's kind: multi-latent attention with a shared expert, at ep2 and tp2-ep2
    (1, 1, 2, 1, "alltoall", True, None, False, 24, "mla"),
    (2, 1, 2, 1, "alltoall", False, None, False, 24, "mla"),
]


def _config(layout):
    tp, pp, ep, etp, disp, grouped, cf, pad = layout[:8]
    shared = layout[8] if len(layout) > 8 else None
    mla = MLA if layout[9:] == ("mla",) else {}
    return moe_config(
        **mla,
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=shared is not None,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=tp > 1,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        moe_token_dispatcher_type=disp,
        moe_grouped_gemm=grouped,
        moe_expert_capacity_factor=cf,
        moe_pad_expert_input_to_capacity=pad,
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
    )


def _dp(layout):
    return WORLD // (layout[0] * layout[1])


def _data(dp):
    return [microbatches(M, seed=10 + d) for d in range(dp)]


def _count_drops(model, dropped: list[int]):
    """Hooks on every router adding the assignments top-k chose but the routing map lacks
    (top-k of the logits, computed here: softmax keeps the order)."""

    def hook(router, inputs, outputs):
        tokens = inputs[0].reshape(-1, inputs[0].size(-1))
        logits = tokens.float() @ router.weight.float().t()
        top = logits.topk(router.config.moe_router_topk, dim=-1).indices
        routed = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
        dropped.append(int((routed & ~outputs[1]).sum()))

    return [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, TopKRouter)]


def _reference(layout):
    config = dataclasses.replace(
        _config(layout),
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=1,
    )
    torch.manual_seed(0)
    spec = moe_spec(config.multi_latent_attention)
    model = GPTModel(config, spec, VOCAB, S, make_vocab_size_divisible_by=DIVISIBLE_BY)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dp, dropped = _dp(layout), []
    hooks = _count_drops(model, dropped)
    set_aux_loss_scale(1.0 / (M * dp))
    losses = []
    for batches in _data(dp):
        per_rank = []
        for ids, pos, labels in batches:
            loss = model(ids, pos, labels=labels)
            (loss.mean() / (M * dp)).backward()
            per_rank.append(loss.detach())
        losses.append(per_rank)
    set_aux_loss_scale(1.0)
    for h in hooks:
        h.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    aux = collect_moe_aux_losses(model)
    return state, losses, grads, aux, sum(dropped)


def _finalize(grid, dp):
    def finalize(chunks, tokens):
        sync_grads(chunks)
        for chunk in chunks:
            for p in chunk.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                expert = not getattr(p, "allreduce", True)
                comm.all_reduce(p.grad, group=grid.group("edp" if expert else "dp-cp"))
                p.grad /= dp

    return finalize


def _forward_step(data_iterator, model):
    ids, pos, labels = next(data_iterator)
    return model(ids, pos, labels=labels), lambda out: (out.mean(), out.detach().clone())


def _case(layout, state):
    tp, pp, ep, etp = layout[:4]
    grid = initialize_model_parallel(ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp))
    try:
        model_parallel_seed(1234, grid)
        config = _config(layout)
        chunks = build_model_chunks(
            config,
            moe_spec(config.multi_latent_attention),
            VOCAB,
            S,
            grid,
            make_vocab_size_divisible_by=DIVISIBLE_BY,
        )
        for c in chunks:
            load_full_state_dict(c, state)
        dp = grid.size("dp")
        pcfg = PipelineConfig(
            hidden_size=config.hidden_size,
            sequence_parallel=config.sequence_parallel,
            finalize_model_grads_func=_finalize(grid, dp),
            aux_loss_scale_func=set_aux_loss_scale,
        )
        losses = get_forward_backward_func(pp, None)(
            forward_step_func=_forward_step,
            data_iterator=iter(_data(dp)[grid.rank("dp")]),
            model=chunks[0],
            num_microbatches=M,
            seq_length=S,
            micro_batch_size=B,
            config=pcfg,
            grid=grid,
        )
        set_aux_loss_scale(1.0)
        aux = collect_moe_aux_losses(chunks, grid)  # collective over pp and tp-dp-cp
        probe = torch.empty(1, config.hidden_size)
        grouped_mm = [
            m.use_grouped_mm(probe)
            for c in chunks
            for m in c.modules()
            if isinstance(m, GroupedMLP)
        ]
        grads = {
            global_param_name(n, c.layer_offset): p.grad.clone()
            for c in chunks
            for n, p in c.named_parameters()
        }
        ranks = {k: grid.rank(k) for k in ("tp", "dp", "ep", "etp")}
        return {
            "ranks": ranks,
            "losses": list(losses),
            "grads": grads,
            "aux": aux,
            "grouped_mm": grouped_mm,
        }
    finally:
        destroy_model_parallel(grid)


def _all_layouts(layouts, states):
    return [_case(lay, states[i]) for i, lay in enumerate(layouts)]


@pytest.fixture(scope="module")
def parity(distributed):
    refs = [_reference(lay) for lay in LAYOUTS]
    per_rank = distributed.run(WORLD, _all_layouts, LAYOUTS, [r[0] for r in refs])
    return refs, [[r[i] for r in per_rank] for i in range(len(LAYOUTS))]


def _merged(results, layout):
    config, ep = _config(layout), layout[2]
    by_name: dict[str, dict] = {}
    for r in results:
        for name, g in r["grads"].items():
            rk = r["ranks"]
            key = (rk["ep"], rk["etp"]) if ".experts." in name else rk["tp"]
            by_name.setdefault(name, {})[key] = g
    return {
        name: merge_shards(name, [s[k] for k in sorted(s)], config=config, ep_size=ep)
        for name, s in by_name.items()
    }


def _name(index):
    return "-".join(map(str, LAYOUTS[index]))


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=_name)
def test_losses_and_grads_match_single_process(parity, index):
    refs, results = parity
    _, ref_losses, ref_grads, _, _ = refs[index]
    results = results[index]
    last = [r for r in results if r["losses"]]
    assert last
    if LAYOUTS[index][5]:  # grouped: every rank's MoE layers run torch._grouped_mm
        assert all(r["grouped_mm"] and all(r["grouped_mm"]) for r in results)
    for r in last:
        for got, want in zip(r["losses"], ref_losses[r["ranks"]["dp"]], strict=True):
            torch.testing.assert_close(got, want, **TOL)
    grads = _merged(results, LAYOUTS[index])
    if LAYOUTS[index][1] > 1:
        torch.testing.assert_close(
            grads.pop("output_layer.weight"), ref_grads["embedding.word_embeddings.weight"], **TOL
        )
    assert sorted(grads) == sorted(ref_grads)
    for name, want in ref_grads.items():
        torch.testing.assert_close(grads[name], want, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=_name)
def test_aux_and_z_losses_match_single_process(parity, index):
    """Every rank's collected per-layer losses [num_layers] equal the reference's (the mean
    over all M * dp micro-batches of each layer's load-balancing and z loss)."""
    refs, results = parity
    ref_aux = refs[index][3]
    assert set(ref_aux) == {"load_balancing_loss", "z_loss"}
    assert all((v > 0).all() for v in ref_aux.values())  # both layers recorded both
    for r in results[index]:
        assert set(r["aux"]) == set(ref_aux)
        for name, want in ref_aux.items():
            torch.testing.assert_close(
                r["aux"][name], want, **TOL, msg=lambda m, n=name: f"{n}: {m}"
            )


@pytest.mark.parametrize(
    "index", [i for i, lay in enumerate(LAYOUTS) if lay[6] is not None], ids=_name
)
def test_capacity_layouts_really_drop_tokens(parity, index):
    refs, _ = parity
    assert refs[index][4] > 0  # assignments dropped in the one-process run
