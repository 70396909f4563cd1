"""Acceptance (`--pipeline-schedule zb-h1` and `zbv`): 6 training steps under the
zero-bubble schedules give the single-process loss and grad norm (before clipping, every
rank) at every step (gloo, fp32, rtol 1e-6: only the order of the sums differs).

- ZB-H1 at pp2, pp4, cp2-pp2 and tp2-pp2-dp2 with sequence parallelism, the distributed
  optimizer and overlapped grad reduce; a MoE GPT at pp2-ep2 against its own one process.
- ZBV (two chunks per rank in a V, untied embeddings, the loss computed on pipeline rank 0
  and reported by the last rank) at pp2, pp4 (8 layers: one per stage of the V), cp2-pp2,
  the tp2-pp2-dp2 layout above and the MoE GPT at pp2-ep2. A checkpoint saved under the V
  resumes under it bitwise, and under 1F1B's placement of the same pp.

Both split each backward into B (input gradients; the parallel linears queue their weight
gradients) and W (the queued weight gradients), run where the schedule table says. The
ordering they must keep: every W before the step's grad reduction. Planting the opposite
(the last W run after finalize_model_grads) must fail the comparison, for each schedule.
"""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _app import TINY_GPT, assert_matches_reference, train_record
from test_e2e_moe import MOE

STEPS, RTOL = 6, 1e-6
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


@pytest.mark.parametrize("experts", ["sequential", "grouped"])
def test_zb_h1_moe_pp2_ep2_matches_one_process(distributed, experts):
    """The experts' weights and biases (the grouped GEMM's added by `experts_bias`) wait
    for W."""
    moe = MOE + (["--moe-grouped-gemm"] if experts == "grouped" else [])
    reference = distributed.run(1, train_record, moe)[0]
    layout = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
    per_rank = distributed.run(4, train_record, moe + layout + ZB)
    assert_matches_reference(per_rank, reference, RTOL)


def test_a_weight_gradient_after_the_reduction_fails(distributed):
    steps = ["--train-iters", "3"]
    reference = distributed.run(1, train_record, COMMON + steps)[0]
    world, flags = LAYOUTS["tp2-pp2-dp2-sp-distopt-overlap"]
    argv = COMMON + flags + ZB + steps
    per_rank = distributed.run(world, train_record, argv, "zb_w_after_reduce")
    with pytest.raises(AssertionError, match="differ from one process"):
        assert_matches_reference(per_rank, reference, RTOL)


# --- ZBV ------------------------------------------------------------------------------------
ZBV = ["--pipeline-schedule", "zbv"]
UNTIED = [*COMMON, "--untie-embeddings-and-output-weights"]
EIGHT_LAYERS = ["--num-layers", "8"]


@pytest.fixture(scope="module")
def untied_reference(distributed):
    return distributed.run(1, train_record, UNTIED)[0]


@pytest.mark.parametrize("layout", ["pp2", "cp2-pp2", "tp2-pp2-dp2-sp-distopt-overlap"])
def test_zbv_matches_one_process(distributed, untied_reference, layout):
    world, flags = LAYOUTS[layout]
    per_rank = distributed.run(world, train_record, UNTIED + flags + ZBV)
    assert_matches_reference(per_rank, untied_reference, RTOL)


def test_zbv_pp4_one_layer_per_stage_matches_one_process(distributed):
    reference = distributed.run(1, train_record, UNTIED + EIGHT_LAYERS)[0]
    world, flags = LAYOUTS["pp4"]
    per_rank = distributed.run(world, train_record, UNTIED + EIGHT_LAYERS + flags + ZBV)
    assert_matches_reference(per_rank, reference, RTOL)


def test_zbv_weight_gradient_after_the_reduction_fails(distributed):
    steps = ["--train-iters", "3"]
    reference = distributed.run(1, train_record, UNTIED + steps)[0]
    world, flags = LAYOUTS["tp2-pp2-dp2-sp-distopt-overlap"]
    argv = UNTIED + flags + ZBV + steps
    per_rank = distributed.run(world, train_record, argv, "zbv_w_after_reduce")
    with pytest.raises(AssertionError, match="differ from one process"):
        assert_matches_reference(per_rank, reference, RTOL)


def test_zbv_moe_pp2_ep2_matches_one_process(distributed):
    untied = [*MOE, "--untie-embeddings-and-output-weights"]
    reference = distributed.run(1, train_record, untied)[0]
    layout = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
    per_rank = distributed.run(4, train_record, untied + layout + ZBV)
    assert_matches_reference(per_rank, reference, RTOL)


def _zbv_checkpoint(root: str) -> tuple[dict, dict, dict]:
    argv = [*UNTIED, "--pipeline-model-parallel-size", "2", "--train-iters", "6"]
    ckpt = os.path.join(root, "ckpt")
    full = train_record([*argv, *ZBV])
    train_record([*argv, *ZBV, "--exit-interval", "3", "--save", ckpt, "--save-interval", "3"])
    return full, train_record([*argv, *ZBV, "--load", ckpt]), train_record([*argv, "--load", ckpt])


def test_zbv_checkpoint_resumes_in_the_v_and_in_1f1b_placement(distributed, tmp_path):
    """Rank 0 holds layers 0 and 3 under the V, 0 and 1 under 1F1B: the checkpoint's
    global layer names put each back where the layout wants it."""
    import torch

    full, v, loop = distributed.run(2, _zbv_checkpoint, str(tmp_path))[1]  # the last rank
    assert len(full["losses"]) == 6 and v["losses"] == full["losses"][3:]
    assert v["grad_norms"] == full["grad_norms"][3:]
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(
            torch.tensor(loop[key]), torch.tensor(full[key][3:]), rtol=RTOL, atol=0.0
        )
