"""--fp16 end to end on CPU (gloo): fp16 params and compute, fp32 main params and grad
reduction, Megatron's loss scaling. Checked against fp32 at one process and against itself
at tp2-pp2-dp2 with sequence parallelism and the distributed optimizer, on losses and every
rank's grad norm before clipping (the norm carries the gradients' scale; Adam and clipping
hide it from the losses).

Tolerances: the fp16-vs-fp32 error measured on 2026-12-06 (10 steps, loss scale 4096), with
a margin of about 4: grad norms rel 2.3e-4 -> 1e-3, losses rel 3.7e-6 -> 2e-5. The
tp2-pp2-dp2 run against one process (fp16 both) measured 1.4e-4 / 2.0e-6. The training
moves the loss by 2.6e-2 (rel) over the 10 steps, a thousand times the loss tolerance.

Planted, each must fail: the loss scale never applied to the loss while the optimizer
divides it out (the bug this file found: grad norms 4096x small, so clipping never
engaged, and fp16 grads underflow on a GPU), and every grad 2x. The loss scale survives a
checkpoint (checked by hand: a scaler that ignores its saved state fails the resume test,
restarting at 2^20).
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _app import TINY_GPT, TP2_PP2, assert_matches_reference, first_steps, train_record

STEPS = 10
NORM_RTOL = 1e-3
LOSS_RTOL = 2e-5
COMMON = [*TINY_GPT, "--train-iters", str(STEPS), "--seed", "7"]
# 4096 stays well below this model's overflow (its grads overflow fp16 from about 2^19)
FP16 = ["--fp16", "--initial-loss-scale", "4096"]
TP2_PP2_DP2_SP_DISTOPT = [*TP2_PP2, "--sequence-parallel", "--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def fp32(distributed):
    return distributed.run(1, train_record, COMMON)[0]


@pytest.fixture(scope="module")
def fp16(distributed):
    return distributed.run(1, train_record, [*COMMON, *FP16])[0]


def test_fp16_trains_as_fp32_does(fp32, fp16):
    assert fp16["loss_scales"] == [4096.0] * STEPS  # the fp16 optimizer ran, no overflow
    assert fp32["loss_scales"] == [None] * STEPS
    assert fp16["grad_norms"] != fp32["grad_norms"]  # not fp32 arithmetic under another name
    assert fp32["losses"][-1] < fp32["losses"][0] - 0.1  # it learns
    assert_matches_reference([fp16], fp32, NORM_RTOL, loss_rtol=LOSS_RTOL)


def test_fp16_tp2_pp2_dp2_matches_one_process(distributed, fp32, fp16):
    per_rank = distributed.run(8, train_record, [*COMMON, *FP16, *TP2_PP2_DP2_SP_DISTOPT])
    assert all(r["loss_scales"] == [4096.0] * STEPS for r in per_rank)
    assert_matches_reference(per_rank, fp16, NORM_RTOL, loss_rtol=LOSS_RTOL)
    assert_matches_reference(per_rank, fp32, NORM_RTOL, loss_rtol=LOSS_RTOL)


@pytest.mark.parametrize("plant", ["fp16_loss_not_scaled", "grad_x2"])
def test_planted_scale_bugs_fail_the_comparison(distributed, fp32, plant):
    steps = 3
    argv = [*COMMON, *FP16, "--exit-interval", str(steps)]
    got = distributed.run(1, train_record, argv, plant=plant)[0]
    assert len(got["losses"]) == steps
    with pytest.raises(AssertionError, match="grad norms"):
        assert_matches_reference([got], first_steps(fp32, steps), NORM_RTOL, LOSS_RTOL)


def _megatron_logged_scales(initial: float, hysteresis: int, overflows: list[bool]) -> list[float]:
    """Megatron's DynamicGradScaler as its log shows it (the scale after each step), written
    here from its documented rule: an overflow uses up one unit of hysteresis, and once
    none is left halves the scale (down to 1); a clean step leaves it (growth after 1000
    clean steps does not happen in these runs)."""
    scale, left, out = initial, hysteresis, []
    for overflow in overflows:
        if overflow:
            left -= 1
            if left <= 0:
                scale = max(scale / 2, 1.0)
        out.append(scale)
    return out


def test_overflowing_steps_are_skipped_and_leave_the_weights(distributed):
    """Megatron's default initial loss scale (2^32) overflows this fresh model's fp16 grads
    at every one of 4 steps: each step is skipped on every rank (no grad norm, the run goes
    on: the grads' NaN/Inf check is off under dynamic scaling, as in Megatron) and the
    weights stay untouched, so the losses are bitwise those of a run at lr 0."""
    argv = [*TINY_GPT, "--train-iters", "4", "--seed", "7"]
    skipped = distributed.run(1, train_record, [*argv, "--fp16"])[0]
    frozen = distributed.run(1, train_record, [*argv, *FP16, "--lr", "0"])[0]
    assert skipped["grad_norms"] == [None] * 4
    assert skipped["loss_scales"] == _megatron_logged_scales(2.0**32, 2, [True] * 4)
    assert all(n is not None and math.isfinite(n) for n in frozen["grad_norms"])  # it stepped
    assert torch.equal(torch.tensor(skipped["losses"]), torch.tensor(frozen["losses"]))


def test_the_loss_scale_resumes_from_a_checkpoint(distributed, tmp_path):
    """2^20 overflows twice (steps 1 and 2: hysteresis 2), then 2^19 trains. Saved at step
    3 and resumed, the run goes on at 2^19 (a scaler restarted at 2^20 would skip steps
    again) with the uninterrupted run's losses and grad norms, bitwise."""
    argv = [*TINY_GPT, "--train-iters", "6", "--seed", "7", "--fp16"]
    argv += ["--initial-loss-scale", str(2**20)]
    full = distributed.run(1, train_record, argv)[0]
    save = ["--exit-interval", "3", "--save", str(tmp_path), "--save-interval", "3"]
    distributed.run(1, train_record, [*argv, *save])
    resumed = distributed.run(1, train_record, [*argv, "--load", str(tmp_path)])[0]
    overflows = [n is None for n in full["grad_norms"]]
    assert overflows == [True, True, False, False, False, False]
    assert full["loss_scales"] == _megatron_logged_scales(2.0**20, 2, overflows)
    assert resumed["loss_scales"] == full["loss_scales"][3:]
    assert resumed["losses"] == full["losses"][3:]
    assert resumed["grad_norms"] == full["grad_norms"][3:]
