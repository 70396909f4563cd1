"""Acceptance: 6 training steps give the same loss and the same grad norm (before
clipping, on every rank) at every step at 1 process, at tp2-pp2-dp2, and at
tp2-pp2(vpp2)-dp2 with sequence parallelism and the distributed optimizer (gloo, fp32,
mock data, the same seed; rtol 1e-6: only the order of the sums differs; measured
2026-12-06 at most 1.0e-7 on the grad norms and 4.4e-8 on the losses over 6 steps). Also with
torch FSDP2 (`--use-torch-fsdp2`, params, grads and optimizer state sharded over dp) in
place of DDP at tp2-pp2(vpp2)-dp2 with SP, and under two of Megatron's pipeline splits: a
custom layout (`--pipeline-model-parallel-layout`, with an empty stage) and the embedding
and loss counted as layers (`--account-for-*-in-pipeline-split`).

The grad norms carry the gradients' scale, which the losses do not show (Adam is
scale-invariant and clipping at 1.0 engages every step here): each planted bug class
(every grad 2x or 0.5x, the 1/micro-batches factor dropped, dp summed instead of
averaged) is run for real and must fail the comparison."""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _app import (
    PLANTS,
    TINY_GPT,
    TP2_PP2,
    assert_matches_reference,
    resumed_losses,
    train_record,
)

STEPS = 6
RTOL = 1e-6

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
    # Megatron's custom layout: rank 0 holds the embedding and layer 0, then an empty
    # stage; rank 1 holds layers 1-3, then only the final norm and the loss
    "tp2-pp2-layout-dp2-sp-distopt": [
        *TP2_PP2,
        "--pipeline-model-parallel-layout",
        "Et|ttt||L",
        "--sequence-parallel",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
    ],
    # the embedding and the loss count as a layer each: 6 slots over pp2 x 3 virtual
    # stages, so the first and the last stage hold no transformer layer
    "tp2-pp2-vpp3-accounted-dp2": [
        *TP2_PP2,
        "--num-virtual-stages-per-pipeline-rank",
        "3",
        "--account-for-embedding-in-pipeline-split",
        "--account-for-loss-in-pipeline-split",
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
    return distributed.run(1, train_record, COMMON)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_and_grad_norms_match_one_process(distributed, reference, layout):
    losses, norms = reference["losses"], reference["grad_norms"]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]  # it learns
    assert len(norms) == STEPS and all(math.isfinite(v) and v > 0 for v in norms)
    per_rank = distributed.run(8, train_record, COMMON + LAYOUTS[layout])
    assert sum(r["losses"][0] is not None for r in per_rank) == 4  # tp2 x dp2, last stage
    assert_matches_reference(per_rank, reference, RTOL)


def test_custom_layout_checkpoint_resumes_at_another_layout(distributed, reference, tmp_path):
    """Saved under the custom layout (a chunk without parameters, ZeRO-1's shards of the
    rest), resumed at tp1-pp1-dp4: the reference's losses of steps 4 and 5 (rtol 1e-5, as
    the other resume-at-another-layout tests: dp4's sums run in another order)."""
    layout = LAYOUTS["tp2-pp2-layout-dp2-sp-distopt"]
    for losses in resumed_losses(distributed, COMMON, layout, str(tmp_path / "ckpt")):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(reference["losses"][3:5]), rtol=1e-5, atol=0.0
        )


PLANT_STEPS = ["--train-iters", "3"]


@pytest.fixture(scope="module")
def short_reference(distributed):
    return distributed.run(1, train_record, COMMON + PLANT_STEPS)[0]


@pytest.mark.parametrize("plant", [None, *PLANTS])
def test_a_planted_bug_fails_the_comparison(distributed, short_reference, plant):
    """None: the same short run without a bug passes, so each failure is the bug's."""
    layout = LAYOUTS["tp2-pp2-vpp2-dp2-sp-distopt"]
    per_rank = distributed.run(8, train_record, COMMON + layout + PLANT_STEPS, plant)
    if plant is None:
        assert_matches_reference(per_rank, short_reference, RTOL)
        return
    with pytest.raises(AssertionError, match="grad norms differ"):
        assert_matches_reference(per_rank, short_reference, RTOL)
