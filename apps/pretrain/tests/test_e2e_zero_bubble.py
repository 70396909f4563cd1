"""Acceptance (`--pipeline-schedule zb-h1`): 10 training steps under the zero-bubble H1
schedule give the single-process loss and grad norm (before clipping, every rank) at every
step at pp2, pp4, cp2-pp2 and tp2-pp2-dp2 with sequence parallelism, the distributed optimizer and
overlapped grad reduce (gloo, fp32, rtol 1e-6: only the order of the sums differs); and a
MoE GPT at pp2-ep2 under ZB-H1 gives its own single-process numbers.

ZB-H1 splits each backward into B (input gradients; the parallel linears queue their weight
gradients) and W (the queued weight gradients), run where the schedule table says. The
ordering it must keep: every W before the step's grad reduction. Planting the opposite (the
last micro-batch's W run after finalize_model_grads) must fail the comparison.
"""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _app import TINY_GPT, assert_matches_reference, train_record
from test_e2e_moe import MOE

STEPS, RTOL = 10, 1e-6
COMMON = [*TINY_GPT, "--train-iters", str(STEPS), "--seed", "7"]
ZB = ["--pipeline-schedule", "zb-h1"]
LAYOUTS = {
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "pp4": (4, ["--pipeline-model-parallel-size", "4"]),
    "cp2-pp2": (4, ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "tp2-pp2-dp2-sp-distopt-overlap": (
        8,
        [
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
        ],
    ),
}


@pytest.fixture(scope="module")
def reference(distributed):
    record = distributed.run(1, train_record, COMMON)[0]
    assert len(record["losses"]) == STEPS and all(math.isfinite(v) for v in record["losses"])
    assert record["losses"][-1] < record["losses"][0]
    return record


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zb_h1_matches_one_process(distributed, reference, layout):
    world, flags = LAYOUTS[layout]
    per_rank = distributed.run(world, train_record, COMMON + flags + ZB)
    assert_matches_reference(per_rank, reference, RTOL)


def test_zb_h1_moe_pp2_ep2_matches_one_process(distributed):
    reference = distributed.run(1, train_record, MOE)[0]
    layout = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
    per_rank = distributed.run(4, train_record, MOE + layout + ZB)
    assert_matches_reference(per_rank, reference, RTOL)


def test_a_weight_gradient_after_the_reduction_fails(distributed):
    steps = ["--train-iters", "3"]
    reference = distributed.run(1, train_record, COMMON + steps)[0]
    world, flags = LAYOUTS["tp2-pp2-dp2-sp-distopt-overlap"]
    argv = COMMON + flags + ZB + steps
    per_rank = distributed.run(world, train_record, argv, "zb_w_after_reduce")
    with pytest.raises(AssertionError, match="differ from one process"):
        assert_matches_reference(per_rank, reference, RTOL)
