"""Acceptance (MoE through the app): 6 training steps of a 4-layer MoE GPT (8 experts,
top-2, aux loss and z-loss on, first layer dense) give the single-process loss and grad
norm (before clipping, every rank) at every step at ep2 with the all-to-all dispatcher
(tp1, dp4), and at tp2-sp-ep2 (etp2) with grouped experts, the all-gather dispatcher and
the distributed optimizer (world 4, gloo, fp32, rtol 1e-6; measured 2026-12-06: at most
1.3e-7 on the norms, 4.4e-8 on the losses; the norm at etp2 was 1e-4 low while the etp
shards of the expert weights counted on etp rank 0 only). A checkpoint saved at ep2 after
3 steps resumes at ep4 (experts resharded, tp2-sp) and continues with the single-process
losses. With aux-loss-free balancing
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

from _app import TINY_GPT, assert_matches_reference, last_stage, train, train_record

STEPS, RTOL = 6, 1e-6
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
    # FSDP2: dense params sharded over dp 4, experts over their edp 2 (their grads summed
    # over edp, divided by dp)
    "ep2-alltoall-fsdp2": [
        "--expert-model-parallel-size",
        "2",
        "--moe-token-dispatcher-type",
        "alltoall",
        "--use-torch-fsdp2",
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
def reference_record(distributed):
    return distributed.run(1, train_record, MOE)[0]


@pytest.fixture(scope="module")
def reference(reference_record):
    return reference_record["losses"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_losses_and_grad_norms_match_one_process(distributed, reference_record, layout):
    reference = reference_record["losses"]
    assert len(reference) == STEPS and all(math.isfinite(v) for v in reference)
    assert reference[-1] < reference[0]
    per_rank = distributed.run(4, train_record, MOE + LAYOUTS[layout])
    assert_matches_reference(per_rank, reference_record, RTOL)


def test_moe_checkpoint_resumes_at_another_expert_layout(distributed, reference, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    ep2 = MOE + LAYOUTS["ep2-alltoall"]
    first = distributed.run(4, train, [*ep2, "--exit-interval", "3", "--save", ckpt])
    ep4 = [*MOE, *TP2_SP, "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1"]
    second = distributed.run(4, train, [*ep4, "--load", ckpt])
    for losses in last_stage(first):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(reference[:3]), rtol=RTOL, atol=0.0
        )
    for losses in last_stage(second):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(reference[3:]), rtol=RTOL, atol=0.0
        )


def test_fsdp2_ep2_checkpoint_resumes_under_ddp_at_ep4(distributed, reference, tmp_path):
    """FSDP2 with experts sharded over their edp ranks writes the experts' rows each rank
    holds under the same keys as DDP: a DDP run at tp2-sp-ep4 (experts resharded) loads
    the model and Adam state and continues with the single-process losses."""
    ckpt = str(tmp_path / "ckpt")
    fsdp2 = MOE + LAYOUTS["ep2-alltoall-fsdp2"]
    first = distributed.run(4, train, [*fsdp2, "--exit-interval", "3", "--save", ckpt])
    ep4 = [*MOE, *TP2_SP, "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1"]
    second = distributed.run(4, train, [*ep4, "--load", ckpt])
    for losses, want in ((last_stage(first), reference[:3]), (last_stage(second), reference[3:])):
        for got in losses:
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=0.0)


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
    first = last_stage(distributed.run(4, train, [*argv, "--exit-interval", "3", "--save", ckpt]))
    second = last_stage(distributed.run(4, train, [*argv, "--load", ckpt]))
    for whole, a, b in zip(full, first, second):
        assert a + b == whole  # bitwise
