"""Acceptance: a 4-layer GPT (GQA, RoPE, SwiGLU, q/k norm, biases) at tp in {1, 2, 4},
sequence parallel on/off, pp in {1, 2} and vpp 2 on pp 2 gives the single-process
per-token losses and the gradient of every parameter (shards merged with
`merge_shards`), fp32, rtol 1e-5 / atol 1e-6. Tied embeddings on the first and last stage
stay identical after an Adam step. Two layouts use the TE spec's layout in PyTorch
(`get_gpt_layer_te_spec(backend="torch")`: norms fused into linear_qkv / linear_fc1,
loaded from the local spec's state dict through the canonical global names). One layout
("local-fused") runs SwiGLU fused (`bias_activation_fusion`) against the unfused reference.

All layouts run in one call on a pool of 4 gloo ranks; the reference runs in this process.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _gpt import (
    DIVISIBLE_BY,
    TOL,
    VOCAB,
    B,
    M,
    S,
    microbatches,
    reference_run,
    small_config,
    with_layout,
)

from pentatron.models import (
    build_model_chunks,
    get_gpt_layer_local_spec,
    get_gpt_layer_te_spec,
    global_param_name,
    load_full_state_dict,
    merge_shards,
    sync_grads,
)
from pentatron.parallel_state import (
    ParallelConfig,
    destroy_model_parallel,
    initialize_model_parallel,
)
from pentatron.pipeline import PipelineConfig, get_forward_backward_func
from pentatron.tp_layers import model_parallel_seed

WORLD = 4
LAYOUTS = [  # (tp, pp, vpp, sequence_parallel, tied, spec[, pipeline layout])
    (1, 1, None, False, True, "local"),
    (2, 1, None, False, True, "local"),
    (2, 1, None, True, True, "local"),
    (4, 1, None, False, True, "local"),
    (4, 1, None, True, True, "local"),
    (1, 2, None, False, True, "local"),
    (2, 2, None, False, True, "local"),
    (2, 2, None, True, True, "local"),
    (2, 2, None, True, False, "local"),
    (1, 2, 2, False, True, "local"),
    (2, 2, 2, True, True, "local"),
    (4, 1, None, True, True, "te-torch"),
    (2, 2, 2, True, True, "te-torch"),
    (2, 2, 2, True, True, "local-fused"),
    # Megatron's custom layouts (pipeline_model_parallel_layout): a chunk with only the
    # embedding, one with only the final norm and the loss, an empty middle chunk
    (2, 2, 2, True, True, "local", "E|tt|tt|L"),
    (1, 2, 2, False, False, "local", "Et|tt||tL"),
]
SPECS = {
    "local": get_gpt_layer_local_spec,
    "local-fused": get_gpt_layer_local_spec,
    "te-torch": lambda: get_gpt_layer_te_spec(backend="torch"),
    "mla": lambda: get_gpt_layer_local_spec(multi_latent_attention=True),  # test_mla.py
}


def _loss(output):
    return output.mean(), output.detach().clone()


def _forward_step(data_iterator, model):
    ids, pos, labels = next(data_iterator)
    return model(ids, pos, labels=labels), _loss


def _run(grid, config, chunks, data):
    vpp = config.virtual_pipeline_model_parallel_size
    pcfg = PipelineConfig(
        hidden_size=config.hidden_size,
        sequence_parallel=config.sequence_parallel,
        finalize_model_grads_func=lambda model_chunks, tokens: sync_grads(model_chunks),
    )
    func = get_forward_backward_func(config.pipeline_model_parallel_size, vpp)
    return func(
        forward_step_func=_forward_step,
        data_iterator=[iter(data) for _ in chunks] if vpp else iter(data),
        model=chunks if vpp else chunks[0],
        num_microbatches=len(data),
        seq_length=S,
        micro_batch_size=B,
        config=pcfg,
        grid=grid,
    )


def _case(grid, base, layout, states, data):
    tp, pp, vpp, sp, tied, spec = layout[:6]
    config = dataclasses.replace(
        with_layout(base, tp, pp, vpp, sp),
        untie_embeddings_and_output_weights=not tied,
        bias_activation_fusion=spec.endswith("-fused"),
        pipeline_model_parallel_layout=layout[6] if len(layout) > 6 else None,
    )
    chunks = build_model_chunks(
        config,
        SPECS[spec](),
        VOCAB,
        S,
        grid,
        make_vocab_size_divisible_by=DIVISIBLE_BY,
    )
    for chunk in chunks:
        load_full_state_dict(chunk, states[tied])
    reduced = _run(grid, config, chunks, data)
    grads = {
        global_param_name(n, c.layer_offset): p.grad.clone()
        for c in chunks
        for n, p in c.named_parameters()
    }
    params = [p for c in chunks for p in c.parameters()]
    torch.optim.Adam(params, lr=1e-2).step()
    tied_after = {}
    for c in chunks:
        if c.share_embeddings_and_output_weights and c.pre_process != c.post_process:
            tied_after["first" if c.pre_process else "last"] = c.shared_embedding_or_output_weight()
    return {
        "tp_rank": grid.rank("tp"),
        "pp_rank": grid.rank("pp"),
        "layers": [
            list(range(c.layer_offset, c.layer_offset + len(c.decoder.layers))) for c in chunks
        ],
        "fused_norms": sum(
            n.endswith("layer_norm_weight") for c in chunks for n, _ in c.named_parameters()
        ),
        "losses": [r for r in reduced],
        "grads": grads,
        "tied_after": {k: v.detach().clone() for k, v in tied_after.items()},
    }


def _all_layouts(base, layouts, states, data):
    out = []
    for layout in layouts:
        tp, pp, vpp = layout[:3]
        grid = initialize_model_parallel(ParallelConfig(tp=tp, pp=pp, vpp=vpp))
        model_parallel_seed(1234 + 100 * grid.rank("pp"), grid)
        try:
            out.append(_case(grid, base, layout, states, data))
        finally:
            destroy_model_parallel(grid)
    return out


@pytest.fixture(scope="module")
def parity(distributed):
    base, data = small_config(), microbatches()
    refs = {
        tied: reference_run(
            dataclasses.replace(base, untie_embeddings_and_output_weights=not tied), data
        )
        for tied in (True, False)
    }
    states = {tied: ref[0] for tied, ref in refs.items()}
    per_rank = distributed.run(WORLD, _all_layouts, base, LAYOUTS, states, data)
    return base, refs, {lay: [r[i] for r in per_rank] for i, lay in enumerate(LAYOUTS)}


def _merged_grads(results, config):
    by_name: dict[str, dict[int, torch.Tensor]] = {}
    for r in results:
        for name, grad in r["grads"].items():
            by_name.setdefault(name, {})[r["tp_rank"]] = grad
    return {
        name: merge_shards(name, [shards[k] for k in sorted(shards)], config=config)
        for name, shards in by_name.items()
    }


@pytest.mark.parametrize(
    "layout",
    LAYOUTS,
    ids=lambda lay: (
        "tp{}-pp{}-vpp{}-sp{}-tied{}-{}".format(*lay) + "".join(f"-{x}" for x in lay[6:])
    ),
)
def test_losses_and_grads_match_single_process(parity, layout):
    base, refs, results = parity
    _, ref_losses, ref_grads = refs[layout[4]]
    results = results[layout]
    for r in results:  # each layer's two norms live in its linears in the TE layout only
        layers = base.num_layers // layout[1]
        assert r["fused_norms"] == (2 * layers if layout[5] == "te-torch" else 0)
    if len(layout) > 6:  # each chunk built the layers its stage of the string holds
        built = {r["pp_rank"]: r["layers"] for r in results}
        assert built == CUSTOM_LAYERS[layout[6]], built
    assert_matches_reference(base, results, layout, ref_losses, ref_grads)


# pp rank -> [global layers of chunk 0, of chunk 1], read off the strings by hand (stage s
# is chunk s // pp of rank s % pp)
CUSTOM_LAYERS = {
    "E|tt|tt|L": {0: [[], [2, 3]], 1: [[0, 1], []]},
    "Et|tt||tL": {0: [[0], []], 1: [[1, 2], [3]]},
}


def assert_matches_reference(base, results, layout, ref_losses, ref_grads) -> dict:
    """The last stage's per-token losses and every merged gradient equal the reference's
    (TOL); returns the merged gradients."""
    last = [r for r in results if r["losses"]]
    assert last, "no rank reported losses"
    for r in last:
        assert len(r["losses"]) == M
        for got, want in zip(r["losses"], ref_losses):
            torch.testing.assert_close(got, want, **TOL)
    grads = _merged_grads(results, base)
    if layout[1] > 1 and layout[4]:  # the last stage's tied copy gets the full grad too
        torch.testing.assert_close(
            grads.pop("output_layer.weight"), ref_grads["embedding.word_embeddings.weight"], **TOL
        )
    assert sorted(grads) == sorted(ref_grads)
    for name, want in ref_grads.items():
        torch.testing.assert_close(grads[name], want, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    return grads


@pytest.mark.parametrize("layout", [lay for lay in LAYOUTS if lay[1] > 1 and lay[4]])
def test_tied_embeddings_identical_after_optimizer_step(parity, layout):
    _, refs, results = parity
    initial = refs[True][0]["embedding.word_embeddings.weight"]
    copies: dict[int, dict[str, torch.Tensor]] = {}
    for r in results[layout]:
        copies.setdefault(r["tp_rank"], {}).update(r["tied_after"])
    for tp_rank, pair in copies.items():
        assert set(pair) == {"first", "last"}, tp_rank
        assert torch.equal(pair["first"], pair["last"])
    shard = copies[0]["first"]
    assert not torch.equal(shard, initial[: shard.size(0)]), "the step changed nothing"
