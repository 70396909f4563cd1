"""Recompute (full uniform/block, selective) with dropout on gives gradients identical
(torch.equal) to no recompute: single process, and tp=2 + SP, pp=2 on 4 ranks."""

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


def _grads(config, grid, data):
    model_parallel_seed(
        77 + 100 * (grid.rank("pp") if grid else 0), grid, tp_rank=None if grid else 0
    )
    chunks = build_model_chunks(config, get_gpt_layer_local_spec(), VOCAB, S, grid)
    if grid is None:
        for ids, pos, labels in data:
            chunks[0](ids, pos, labels=labels).mean().backward()
    else:
        _run(grid, config, chunks, data)
    return {
        global_param_name(n, c.layer_offset): p.grad.clone()
        for c in chunks
        for n, p in c.named_parameters()
    }


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


def _check(out):
    ref = out["none"]
    for mode in MODES:
        for name, g in ref.items():
            assert torch.equal(out[mode][name], g), f"{mode}: {name}"
    assert any(not torch.equal(out["no-dropout"][n], g) for n, g in ref.items()), "dropout inactive"


def test_recompute_single_process():
    _check(_all_modes(small_config(), microbatches(2), None))


@pytest.mark.parametrize("layout", [(2, 2)])
def test_recompute_tp2_sp_pp2(distributed, layout):
    for out in distributed.run(4, _all_modes, small_config(), microbatches(2), layout):
        _check(out)
