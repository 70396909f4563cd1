"""Acceptance: 10 training steps give the same loss at every step at 1 process, at
tp2-pp2-dp2, and at tp2-pp2(vpp2)-dp2 with sequence parallelism and the distributed
optimizer (gloo, fp32, mock data, the same seed; rtol 1e-4: only the order of the sums
differs, and Adam amplifies those differences slightly over 10 steps)."""

from __future__ import annotations

import math

import pytest
import torch

STEPS = 10
RTOL = 1e-4

COMMON = [
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--swiglu",
    "--ffn-hidden-size",
    "64",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "16",
    "--mock-data",
    "--vocab-size",
    "255",
    "--make-vocab-size-divisible-by",
    "32",
    "--train-iters",
    str(STEPS),
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "2",
    "--eval-iters",
    "0",
    "--seed",
    "7",
    "--log-interval",
    "1",
    "--no-progress",
]
LAYOUTS = {
    "tp2-pp2-dp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    "tp2-pp2-vpp2-dp2-sp-distopt": [
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
        "--sequence-parallel",
        "--use-distributed-optimizer",
    ],
}


def _train(argv):
    import torch.distributed as dist

    from pentatron.parallel_state import destroy_model_parallel
    from pentatron.pretrain.arguments import parse_args, validate_args
    from pentatron.pretrain.pretrain_gpt import pretrain

    args = validate_args(parse_args(argv), dist.get_world_size())
    try:
        state = pretrain(args)
    finally:
        destroy_model_parallel()
    return state.losses


@pytest.fixture(scope="module")
def reference(distributed):
    return distributed.run(1, _train, COMMON)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_match_one_process(distributed, reference, layout):
    per_rank = distributed.run(8, _train, COMMON + LAYOUTS[layout])
    assert len(reference) == STEPS and all(math.isfinite(v) for v in reference)
    assert reference[-1] < reference[0]  # it learns
    last_stage = [r for r in per_rank if r[0] is not None]
    assert len(last_stage) == 4  # tp2 x dp2 ranks of the last pipeline stage
    for losses in last_stage:
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(reference), rtol=RTOL, atol=0.0
        )
