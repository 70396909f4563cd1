"""`LayerCudaGraphs` on CPU through `eager_capture` (replays re-run the captured function and
write into the captured outputs, as a CUDA graph writes its static buffers).

One process, fp32, 2 micro-batches a step with gradient accumulation: the graphed model's
per-token losses and every parameter grad equal the eager model's exactly at every step
(the same kernels on the same values), and each layer is captured once per micro-batch
position. A step unlike the captured one, eval, and the config's refusals.
The CUDA path itself: tools/device_checks/cuda_graphs.py.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _gpt import VOCAB, B, S, build_reference, microbatches, small_config

from pentatron.models import CudaGraphError, LayerCudaGraphs, ModelConfigError, eager_capture

STEPS, WARMUP, M = 4, 2, 2


def _steps(model, graphs=None):
    """Per step: (losses of each micro-batch, grads); SGD moves the weights in place."""
    data = microbatches(M * STEPS, seed=5)
    out = []
    for step in range(STEPS):
        if graphs is not None:
            graphs.begin_step()
        losses = []
        for ids, pos, labels in data[step * M : (step + 1) * M]:
            loss = model(ids, pos, labels=labels)
            (loss.mean() / M).backward()
            losses.append(loss.detach())
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad  # in place: a graph reads the params' storage
                p.grad = None
        out.append((losses, grads))
    return out


def test_graphed_layers_match_eager_exactly():
    config = dataclasses.replace(small_config(), enable_cuda_graph=True)
    eager = _steps(build_reference(config))
    model = build_reference(config)
    captured = []

    def capture(fn, pool):
        graph, result = eager_capture(fn, pool)
        captured.append(graph)
        return graph, result

    graphed = _steps(model, LayerCudaGraphs([model], warmup_steps=WARMUP, capture=capture))
    for (le, ge), (lg, gg) in zip(eager, graphed):
        for a, b in zip(le, lg):
            assert torch.equal(a, b)
        assert ge.keys() == gg.keys()
        for name in ge:
            assert torch.equal(ge[name], gg[name]), name
    # forward + backward graph per (layer, micro-batch), replayed in each later step
    assert len(captured) == 2 * config.num_layers * M
    assert all(g.replays == STEPS - WARMUP for g in captured)


def test_a_step_unlike_the_captured_one_fails_clearly():
    model = build_reference(dataclasses.replace(small_config(), enable_cuda_graph=True))
    graphs = LayerCudaGraphs([model], warmup_steps=1, capture=eager_capture)
    ids = torch.randint(0, VOCAB, (B, S))
    pos = torch.arange(S).expand(B, S)

    def step(micro_batches):
        graphs.begin_step()
        for _ in range(micro_batches):
            model(ids, pos, labels=ids).sum().backward()

    step(1)
    step(1)  # captured at its start, then replayed
    with pytest.raises(CudaGraphError, match="more micro-batches"):
        step(2)
    with pytest.raises(CudaGraphError, match="fixed shapes"):
        graphs.begin_step()
        model(ids[:1], pos[:1], labels=ids[:1])
    graphs.calls.clear()
    model.eval()
    with torch.no_grad():  # eval runs eagerly, whatever was captured
        assert model(ids, pos, labels=ids).shape == (B, S)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"hidden_dropout": 0.1}, "hidden_dropout"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"recompute_granularity": "selective"}, "recompute_granularity"),
        ({"num_moe_experts": 4, "moe_ffn_hidden_size": 16}, "num_moe_experts"),
        ({"context_parallel_size": 2}, "context_parallel_size"),
        ({"cuda_graph_warmup_steps": 0}, "cuda_graph_warmup_steps"),
    ],
)
def test_what_a_graph_cannot_hold_is_refused(overrides, field):
    with pytest.raises(ModelConfigError, match=f"^{field}="):
        small_config(enable_cuda_graph=True, **overrides)
