"""--calculate-per-token-loss end to end: 3 steps at tp2-pp2-dp2 give the same losses and
grad norms (before clipping, every rank) as one process (gloo, fp32, rtol 1e-6).

The loss mask keeps the first `1 + labels[b, 0] % S` positions of each sample (a function
of the data, so the same at every layout): micro-batches hold different token counts, and
the per-token mean over the step (sum of losses / the step's tokens, summed over pp and
dp) differs from Megatron's default mean of per-micro-batch means. Independent check, one
process: step 1's reported loss (the same weights) is the same with and without the flag,
and its grad norm is not (the flag reaches the gradients).
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _app import TINY_GPT, TP2_PP2, assert_matches_reference, train_record

ARGV = [*TINY_GPT, "--train-iters", "3", "--seed", "11"]
PER_TOKEN = ["--calculate-per-token-loss"]
RTOL = 1e-6


def _masked(get_batch):
    """`get_batch` with the loss mask cut to the first 1 + labels[b, 0] % s positions."""

    def masked(*args, **kwargs):
        batch = get_batch(*args, **kwargs)
        if batch is not None:
            labels = batch["labels"]
            keep = 1 + labels[:, :1] % labels.size(1)  # [b, 1]
            positions = torch.arange(labels.size(1), device=labels.device)
            batch["loss_mask"] = batch["loss_mask"] * (positions < keep).float()
        return batch

    return masked


def train_masked(argv: list[str]) -> dict[str, list]:
    """`train_record` with the varying loss mask above."""
    from unittest import mock

    from pentatron.pretrain import gpt_step

    with mock.patch.object(gpt_step, "get_batch", _masked(gpt_step.get_batch)):
        return train_record(argv)


@pytest.fixture(scope="module")
def one_process(distributed):
    return distributed.run(1, train_masked, ARGV + PER_TOKEN)[0]


def test_per_token_loss_is_active_in_one_process(distributed, one_process):
    default = distributed.run(1, train_masked, ARGV)[0]
    assert all(math.isfinite(v) for v in one_process["losses"] + one_process["grad_norms"])
    # step 1: same weights, same data; the report is sum / tokens either way
    assert math.isclose(one_process["losses"][0], default["losses"][0], rel_tol=1e-6)
    on, off = one_process["grad_norms"][0], default["grad_norms"][0]
    assert not math.isclose(on, off, rel_tol=1e-3), f"the flag changed no gradient: {on} {off}"


def test_per_token_loss_tp2_pp2_dp2_matches_one_process(distributed, one_process):
    per_rank = distributed.run(8, train_masked, ARGV + TP2_PP2 + PER_TOKEN)
    assert sum(r["losses"][0] is not None for r in per_rank) == 4  # tp2 x dp2, last stage
    assert_matches_reference(per_rank, one_process, RTOL)
