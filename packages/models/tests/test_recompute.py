"""Recompute (full uniform/block, selective) with dropout on gives gradients identical
(torch.equal) to no recompute: single process, and tp=2 + SP, pp=2 on 4 ranks.

That it really recomputes is checked by counting forward calls: a recomputed layer (full)
or core attention (selective) runs twice per micro-batch (once under no_grad, once in
backward), the rest once; and (single process) by the bytes autograd saves in forward,
which recompute must lower. Recompute silently turned off fails both."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _gpt import VOCAB, S, microbatches, small_config, with_layout
from test_parity import _run

from pentatron.models import build_model_chunks, get_gpt_layer_local_spec, global_param_name
from pentatron.parallel_state import (
    ParallelConfig,
    destroy_model_parallel,
    initialize_model_parallel,
)
from pentatron.tp_layers import model_parallel_seed

MODES = {
    "none": {},
    "full-uniform-1": dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    ),
    "full-uniform-2": dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2
    ),
    "full-block-1": dict(
        recompute_granularity="full", recompute_method="block", recompute_num_layers=1
    ),
    "selective": dict(recompute_granularity="selective"),
}
DROPOUT = dict(attention_dropout=0.2, hidden_dropout=0.2)


def _count_calls(chunks):
    """Forward calls of every layer and core attention, keyed by (global layer, part), and
    of those made under no_grad (the first, discarded pass of a checkpoint)."""
    calls: dict[tuple[int, str], int] = {}
    no_grad: dict[tuple[int, str], int] = {}

    def hook(key):
        def count(module, args, output):
            calls[key] = calls.get(key, 0) + 1
            if not torch.is_grad_enabled():
                no_grad[key] = no_grad.get(key, 0) + 1

        return count

    for c in chunks:
        for i, layer in enumerate(c.decoder.layers):
            g = c.layer_offset + i
            layer.register_forward_hook(hook((g, "layer")))
            layer.self_attention.core_attention.register_forward_hook(hook((g, "core")))
    return calls, no_grad


def _grads(config, grid, data):
    model_parallel_seed(
        77 + 100 * (grid.rank("pp") if grid else 0), grid, tp_rank=None if grid else 0
    )
    chunks = build_model_chunks(config, get_gpt_layer_local_spec(), VOCAB, S, grid)
    calls, no_grad = _count_calls(chunks)
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    if grid is None:
        for ids, pos, labels in data:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = chunks[0](ids, pos, labels=labels).mean()
            loss.backward()
    else:
        _run(grid, config, chunks, data)
    grads = {
        global_param_name(n, c.layer_offset): p.grad.clone()
        for c in chunks
        for n, p in c.named_parameters()
    }
    offsets = [c.layer_offset for c in chunks]
    return {
        "grads": grads,
        "calls": calls,
        "no_grad": no_grad,
        "saved": saved[0],
        "offsets": offsets,
    }


def _recomputed(mode, layer, offsets):
    """(layer recomputed, core attention recomputed) for global `layer` under `mode`."""
    first_of_chunk = layer in offsets
    full = {"none": False, "selective": False, "full-block-1": first_of_chunk}
    layer_rc = full.get(mode, mode.startswith("full-uniform"))
    return layer_rc, layer_rc or mode == "selective"


def _all_modes(base, data, layout):
    grid = None
    if layout is not None:
        grid = initialize_model_parallel(ParallelConfig(tp=layout[0], pp=layout[1]))
    try:
        out = {}
        for name, extra in MODES.items():
            config = dataclasses.replace(base, **DROPOUT, **extra)
            if layout is not None:
                config = with_layout(config, layout[0], layout[1], None, True)
            out[name] = _grads(config, grid, data)
        nodrop = dataclasses.replace(base, attention_dropout=0.0, hidden_dropout=0.0)
        if layout is not None:
            nodrop = with_layout(nodrop, layout[0], layout[1], None, True)
        out["no-dropout"] = _grads(nodrop, grid, data)
        return out
    finally:
        if grid is not None:
            destroy_model_parallel(grid)


def _check(out, m, single_process=False):
    ref = out["none"]["grads"]
    for mode in MODES:
        for name, g in ref.items():
            assert torch.equal(out[mode]["grads"][name], g), f"{mode}: {name}"
        calls, no_grad, offsets = out[mode]["calls"], out[mode]["no_grad"], out[mode]["offsets"]
        assert calls, f"{mode}: no layer ran"
        for (layer, part), n in calls.items():
            rc = _recomputed(mode, layer, offsets)[part == "core"]
            want = (2 if rc else 1) * m
            assert n == want, f"{mode}: layer {layer} {part} ran {n}x, want {want} ({m} mbs)"
            assert no_grad.get((layer, part), 0) == (m if rc else 0), f"{mode}: {layer} {part}"
        if single_process and mode != "none":
            assert out[mode]["saved"] < out["none"]["saved"], f"{mode}: saves as much as none"
    if single_process:  # full uniform-1 keeps only each layer's inputs: far below selective
        assert out["full-uniform-1"]["saved"] < out["selective"]["saved"]
    nodrop = out["no-dropout"]["grads"]
    assert any(not torch.equal(nodrop[n], g) for n, g in ref.items()), "dropout inactive"


def test_recompute_single_process():
    _check(_all_modes(small_config(), microbatches(2), None), 2, single_process=True)


@pytest.mark.parametrize("layout", [(2, 2)])
def test_recompute_tp2_sp_pp2(distributed, layout):
    for out in distributed.run(4, _all_modes, small_config(), microbatches(2), layout):
        _check(out, 2)
