"""Acceptance (MoE through the app): 10 training steps of a 4-layer MoE GPT (8 experts,
top-2, aux loss and z-loss on, first layer dense) give the single-process loss at every
step at ep2 with the all-to-all dispatcher (tp1, dp4), and at tp2-sp-ep2 with grouped
experts, the all-gather dispatcher and the distributed optimizer (world 4, gloo, fp32,
rtol 1e-4). A checkpoint saved at ep2 after 6 steps resumes at ep4 (experts resharded,
tp2-sp) and continues with the single-process losses. With aux-loss-free balancing
(sigmoid router, expert bias updated every step) a resume at the same layout is bitwise
the uninterrupted run, so the biases are saved and restored.

ep is carved out of dp: each dp rank's micro-batches are the single process's micro-batches
(consecutive pairs of samples), so the per-micro-batch aux losses match too.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _app import TINY_GPT, last_stage, train

STEPS, RTOL = 10, 1e-4
MOE = [
    *TINY_GPT,
    "--num-experts",
    "8",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "32",
    "--moe-layer-freq",
    "[0]*1+[1]*3",
    "--moe-aux-loss-coeff",
    "1e-2",
    "--moe-z-loss-coeff",
    "1e-3",
    "--train-iters",
    str(STEPS),
    "--seed",
    "11",
]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LAYOUTS = {
    "ep2-alltoall": [
        "--expert-model-parallel-size",
        "2",
        "--moe-token-dispatcher-type",
        "alltoall",
    ],
    "tp2-sp-ep2-grouped-allgather-distopt": [
        *TP2_SP,
        "--expert-model-parallel-size",
        "2",
        "--moe-grouped-gemm",
        "--use-distributed-optimizer",
    ],
}


@pytest.fixture(scope="module")
def reference(distributed):
    return distributed.run(1, train, MOE)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_losses_match_one_process(distributed, reference, layout):
    assert len(reference) == STEPS and all(math.isfinite(v) for v in reference)
    assert reference[-1] < reference[0]
    for losses in last_stage(distributed.run(4, train, MOE + LAYOUTS[layout])):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(reference), rtol=RTOL, atol=0.0
        )


def test_moe_checkpoint_resumes_at_another_expert_layout(distributed, reference, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    ep2 = MOE + LAYOUTS["ep2-alltoall"]
    first = distributed.run(4, train, [*ep2, "--exit-interval", "6", "--save", ckpt])
    ep4 = [*MOE, *TP2_SP, "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1"]
    second = distributed.run(4, train, [*ep4, "--load", ckpt])
    for losses in last_stage(first):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(reference[:6]), rtol=RTOL, atol=0.0
        )
    for losses in last_stage(second):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(reference[6:]), rtol=RTOL, atol=0.0
        )


def test_expert_bias_survives_save_and_resume(distributed, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    argv = (
        MOE
        + LAYOUTS["ep2-alltoall"]
        + [
            "--moe-router-score-function",
            "sigmoid",
            "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate",
            "1e-1",
            "--moe-aux-loss-coeff",
            "0",
        ]
    )
    full = last_stage(distributed.run(4, train, argv))
    first = last_stage(distributed.run(4, train, [*argv, "--exit-interval", "6", "--save", ckpt]))
    second = last_stage(distributed.run(4, train, [*argv, "--load", ckpt]))
    for whole, a, b in zip(full, first, second):
        assert a + b == whole  # bitwise
