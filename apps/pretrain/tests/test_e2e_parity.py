"""Acceptance: 10 training steps give the same loss at every step at 1 process, at
tp2-pp2-dp2, and at tp2-pp2(vpp2)-dp2 with sequence parallelism and the distributed
optimizer (gloo, fp32, mock data, the same seed; rtol 1e-4: only the order of the sums
differs, and Adam amplifies those differences slightly over 10 steps). Also with torch
FSDP2 (`--use-torch-fsdp2`, params, grads and optimizer state sharded over dp) in place of
DDP at tp2-pp2(vpp2)-dp2 with SP."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _app import TINY_GPT, TP2_PP2, last_stage, train

STEPS = 10
RTOL = 1e-4

COMMON = [
    *TINY_GPT,
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--train-iters",
    str(STEPS),
    "--seed",
    "7",
]
LAYOUTS = {
    "tp2-pp2-dp2": TP2_PP2,
    "tp2-pp2-vpp2-dp2-sp-distopt": [
        *TP2_PP2,
        "--num-layers-per-virtual-pipeline-stage",
        "1",
        "--sequence-parallel",
        "--use-distributed-optimizer",
    ],
    "tp2-pp2-vpp2-dp2-sp-fsdp2": [
        *TP2_PP2,
        "--num-layers-per-virtual-pipeline-stage",
        "1",
        "--sequence-parallel",
        "--use-torch-fsdp2",
    ],
}


@pytest.fixture(scope="module")
def reference(distributed):
    return distributed.run(1, train, COMMON)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_match_one_process(distributed, reference, layout):
    per_rank = distributed.run(8, train, COMMON + LAYOUTS[layout])
    assert len(reference) == STEPS and all(math.isfinite(v) for v in reference)
    assert reference[-1] < reference[0]  # it learns
    last = last_stage(per_rank)
    assert len(last) == 4  # tp2 x dp2 ranks of the last pipeline stage
    for losses in last:
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(reference), rtol=RTOL, atol=0.0
        )
