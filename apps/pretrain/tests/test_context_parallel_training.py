"""Acceptance: the app trains a 4-layer GPT (GQA, RoPE, SwiGLU) for 5 steps with the same
loss and grad norm (before clipping, every rank) at every step at one process, at
cp2-tp2-dp2 with sequence parallelism (ring attention), at cp2-pp2 (all-to-all
attention) and at cp4 with hierarchical a2a+p2p (2 x 2): this proves get_batch's cp sharding and the loss and grad reduction over cp
(gloo, fp32, mock data, the same seed; rtol 1e-6; measured 2026-12-05: at most 1.1e-7 on
the norms, 8.7e-8 on the losses). Bad cp flags fail in validate_args with one clear line."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _app import TINY_GPT, assert_matches_reference, train_record

from pentatron.pretrain.arguments import parse_args, validate_args
from pentatron.pretrain.arguments_validate import ArgumentError

STEPS = 5
RTOL = 1e-6
COMMON = [
    *TINY_GPT,
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--position-embedding-type",
    "rope",
    "--train-iters",
    str(STEPS),
    "--seed",
    "7",
]
CP2_TP2_DP2 = [
    "--context-parallel-size",
    "2",
    "--tensor-model-parallel-size",
    "2",
    "--sequence-parallel",
    "--cp-comm-type",
    "p2p",
]
CP2_PP2 = ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
CP2_PP2 += ["--cp-comm-type", "a2a"]
HCP4 = ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"]
HCP4 += ["--hierarchical-context-parallel-sizes", "2", "2"]


@pytest.fixture(scope="module")
def reference(distributed):
    return distributed.run(1, train_record, COMMON)[0]


def _check(per_rank, reference, expected_ranks):
    losses = reference["losses"]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]  # it learns
    assert sum(r["losses"][0] is not None for r in per_rank) == expected_ranks
    assert_matches_reference(per_rank, reference, RTOL)


def test_cp2_tp2_dp2_matches_one_process(distributed, reference):
    _check(distributed.run(8, train_record, COMMON + CP2_TP2_DP2), reference, 8)


def test_cp2_pp2_matches_one_process(distributed, reference):
    _check(distributed.run(4, train_record, COMMON + CP2_PP2), reference, 2)


def test_cp4_hierarchical_a2a_p2p_matches_one_process(distributed, reference):
    """The all-to-all over cp rank pairs, the ring over the pairs (grid groups hcp0, hcp1)."""
    _check(distributed.run(4, train_record, COMMON + HCP4), reference, 4)


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--cp-comm-type", "a2a+p2p"], "needs --hierarchical-context-parallel-sizes"),
        (
            ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"],
            "hierarchical-context-parallel-sizes=2 2.*multiply to --context-parallel-size 2",
        ),
        (
            [
                "--cp-comm-type",
                "a2a+p2p",
                "--hierarchical-context-parallel-sizes",
                "2",
                "1",
                "--num-query-groups",
                "1",
            ],
            "num-query-groups=1.*tp\\*2 = 2",
        ),
        (["--cp-comm-type", "p2p", "a2a"], "one type for every layer"),
        (
            ["--seq-length", "18", "--max-position-embeddings", "18"],
            "seq-length=18.*divisible by 2\\*cp",
        ),
        (["--cp-comm-type", "a2a", "--num-query-groups", "1"], "num-query-groups"),
        (["--attention-dropout", "0.1"], "attention-dropout"),
    ],
)
def test_bad_cp_flags(extra, match):
    argv = [*COMMON, "--context-parallel-size", "2", *extra]
    with pytest.raises(ArgumentError, match=match):
        validate_args(parse_args(argv), 2)


def _masked_loss_over_cp(mask_full, values_full):
    """One micro-batch through get_batch's cp cut and loss_func, then the schedule's divide
    by the token count and DDP's grad average over dp x cp (here cp ranks only)."""
    import torch.distributed as dist

    from pentatron.models.context_parallel import get_batch_on_this_cp_rank
    from pentatron.pretrain.gpt_step import loss_func

    cp, rank = dist.get_world_size(), dist.get_rank()
    w = torch.tensor(1.5, requires_grad=True)
    batch = get_batch_on_this_cp_rank({"loss_mask": mask_full, "labels": values_full}, cp, rank)
    output = w * batch["labels"].float() ** 2  # a per-token "loss" [b, s/cp]
    loss, num_tokens, report = loss_func(batch["loss_mask"], output, dist.group.WORLD)
    (loss / num_tokens).backward()
    grad = w.grad.clone()
    dist.all_reduce(grad)
    return {"grad": grad / cp, "report": report["lm loss"], "tokens": int(num_tokens)}


def test_loss_is_reduced_over_cp_by_token_count(distributed):
    """Masks that put different token counts on the cp ranks: the reported loss, the token
    count and the grad equal one process's per-token mean over the whole sequence (a mean of
    the ranks' local means would differ)."""
    g = torch.Generator().manual_seed(3)
    values = torch.randint(1, 9, (2, 16), generator=g)
    mask = torch.zeros(2, 16)
    mask[:, :3] = 1.0  # all on cp rank 0's first chunk
    mask[0, 13] = 1.0  # one token on rank 0's second chunk (chunk 3 of 4)
    mask[1, 5] = 1.0  # one token on rank 1 (chunk 1)
    w = torch.tensor(1.5, requires_grad=True)
    full = w * values.float() ** 2
    expected = (full * mask).sum() / mask.sum()
    expected.backward()
    for got in distributed.run(2, _masked_loss_over_cp, mask, values):
        assert got["tokens"] == int(mask.sum())
        loss_sum, count = got["report"]
        torch.testing.assert_close(loss_sum / count, expected.detach(), rtol=1e-6, atol=0)
        torch.testing.assert_close(got["grad"], w.grad, rtol=1e-6, atol=0)
