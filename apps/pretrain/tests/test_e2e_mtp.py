"""Multi-token prediction through the app (Megatron's `--mtp-num-layers`,
`--mtp-loss-scaling-factor`): 6 steps give the losses, each depth's MTP loss and the grad
norms (before clipping, every rank) of one process, fp32, rtol 1e-6 (the order of sums):

- a DeepSeek-like tiny model (MLA, a dense first layer then MoE with a shared expert, two
  MTP depths, so the MTP layers are MoE) at tp2-pp2-dp2 with SP and the distributed
  optimizer (the MTP layers and the embedding's copy on the last stage) and at tp2-ep2+SP;
- the same under Megatron's custom pipeline layout 'Et||ttt|mmL' at pp2-dp2 (the MTP
  layers and the loss alone in the last stage, an empty stage before it);
- Megatron's standalone MTP stage ('Et|t|t|t|||mm|L' at pp4: the MTP layers on rank 2's
  second stage, the loss alone on rank 3's; untied embeddings) at tp2+SP with the
  DeepSeek-like model, at cp2 with the dense one, and under FSDP2 at dp2. Pipeline rank 0
  holds no expert and no router there: the expert grad norm and the aux-loss collection
  must still take part in their collectives (they hung / failed before);
- a dense GPT at cp2-tp2+SP (the rolls cross the cp chunks) and, with
  --calculate-per-token-loss, at pp2-dp2.
Planted: MTP token counts not summed over cp fail the cp2 comparison. Checkpoints saved at
tp2-pp2-dp2 and at the standalone MTP layout resume at dp4 with the reference's next
losses. The memory calculator
sizes MTP (proven in test_memory_measure.py); a Llama-form export refuses it by name.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _app import (
    TINY_GPT,
    TP2_PP2,
    assert_matches_reference,
    first_steps,
    last_stage,
    train,
    train_record,
)
from test_e2e_mla import MLA, MOE  # the DeepSeek-like tiny model's flags

MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]
STEPS = ["--train-iters", "6", "--seed", "9"]
DEEPSEEK = [*TINY_GPT, *MLA, *MOE, *MTP, *STEPS]
# Global batch 8: 4 micro-batches at cp2-tp2 (dp 1), 2 at pp2-dp2 (per-token).
DENSE = [*TINY_GPT, *MTP, *STEPS, "--transformer-impl", "local", "--global-batch-size", "8"]
PER_TOKEN = [*DENSE, "--calculate-per-token-loss"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
STANDALONE = [
    *("--pipeline-model-parallel-size", "4"),
    *("--pipeline-model-parallel-layout", "Et|t|t|t|||mm|L"),
]
CASES = {  # name: (reference flags, layout flags, world)
    "deepseek-tp2-pp2-dp2-sp-distopt": (
        DEEPSEEK,
        [*TP2_PP2, "--sequence-parallel", "--use-distributed-optimizer"],
        8,
    ),
    "deepseek-tp2-ep2-sp": (DEEPSEEK, [*TP2, "--expert-model-parallel-size", "2"], 4),
    "dense-cp2-tp2-sp": (DENSE, [*TP2, "--context-parallel-size", "2"], 4),
    "per-token-pp2-dp2": (PER_TOKEN, ["--pipeline-model-parallel-size", "2"], 4),
    # Megatron's custom layout: the two MTP layers with the loss in a stage without
    # transformer layers, after an empty stage (pp2 with 2 stages a rank)
    "deepseek-pp2-layout-dp2": (
        DEEPSEEK,
        ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et||ttt|mmL"],
        4,
    ),
    # Megatron's standalone MTP stage, as in its DeepSeek-V3 layout 'Et*3|(tt|)*29,m|L':
    # the MTP layers on pipeline rank 2's second stage with the final norm and an embedding
    # copy, the loss alone on rank 3's; untied embeddings, SP at tp2
    "deepseek-untied-tp2-pp4-standalone-mtp": (
        [*DEEPSEEK, "--untie-embeddings-and-output-weights"],
        [*STANDALONE, "--tensor-model-parallel-size", "2", "--sequence-parallel"],
        8,
    ),
    # the same layout at cp2 (rank 0's empty second stage computes no cp positions) and
    # under FSDP2 (an empty stage is a unit without parameters)
    "dense-untied-cp2-pp4-standalone-mtp": (
        [*DENSE, "--untie-embeddings-and-output-weights"],
        [*STANDALONE, "--context-parallel-size", "2"],
        8,
    ),
    "deepseek-untied-pp4-dp2-standalone-mtp-fsdp2": (
        [*DEEPSEEK, "--untie-embeddings-and-output-weights"],
        [*STANDALONE, "--use-torch-fsdp2"],
        8,
    ),
}


REFERENCES = {
    "deepseek": DEEPSEEK,
    "deepseek-untied": [*DEEPSEEK, "--untie-embeddings-and-output-weights"],
    "dense": DENSE,
    "dense-untied": [*DENSE, "--untie-embeddings-and-output-weights"],
    "per-token": PER_TOKEN,
}


@pytest.fixture(scope="module")
def references(distributed):
    return {key: distributed.run(1, train_record, flags)[0] for key, flags in REFERENCES.items()}


def _reference(references, case):
    return references[next(k for k, flags in REFERENCES.items() if CASES[case][0] == flags)]


def _assert_mtp_losses_match(per_rank, reference, rtol):
    want = torch.tensor([list(d.values()) for d in reference["mtp_losses"]], dtype=torch.float64)
    assert want.shape == (len(reference["losses"]), 2)  # every step, both MTP depths
    for rec in per_rank:
        if rec["losses"][0] is None:
            assert all(d is None for d in rec["mtp_losses"])  # not the last stage
            continue
        got = torch.tensor([list(d.values()) for d in rec["mtp_losses"]], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=rtol, atol=0.0)


@pytest.mark.parametrize("case", list(CASES))
def test_losses_mtp_losses_and_grad_norms_match_one_process(distributed, references, case):
    ref_flags, layout, world = CASES[case]
    reference = _reference(references, case)
    assert reference["losses"][-1] < reference["losses"][0]  # it learns
    mtp = [d["mtp_1 loss"] for d in reference["mtp_losses"]]
    assert mtp[-1] < mtp[0] and all(d["mtp_2 loss"] > 0 for d in reference["mtp_losses"])
    per_rank = distributed.run(world, train_record, ref_flags + layout)
    assert_matches_reference(per_rank, reference, 1e-6)
    _assert_mtp_losses_match(per_rank, reference, 1e-6)


def test_local_mtp_token_counts_under_cp_are_caught(distributed, references):
    """Planted: each cp rank divides its MTP loss by its own token count."""
    ref_flags, layout, world = CASES["dense-cp2-tp2-sp"]
    argv = ref_flags + layout + ["--exit-interval", "2"]
    per_rank = distributed.run(world, train_record, argv, "mtp_local_counts")
    with pytest.raises(AssertionError, match="not close"):
        _assert_mtp_losses_match(per_rank, first_steps(references["dense"], 2), 1e-6)


@pytest.mark.parametrize(
    "case", ["deepseek-tp2-pp2-dp2-sp-distopt", "deepseek-untied-tp2-pp4-standalone-mtp"]
)
def test_mtp_checkpoint_resumes_at_another_layout(distributed, references, tmp_path, case):
    """Saved at the case's layout (the standalone MTP stage's embedding copy and MTP
    layers on a middle rank), resumed at tp1-pp1-dp4: the reference's steps 5 and 6."""
    ckpt = str(tmp_path / "ckpt")
    ref_flags, layout, world = CASES[case]
    save = [*ref_flags, *layout, "--save", ckpt, "--save-interval", "4", "--exit-interval", "4"]
    distributed.run(world, train, save)
    resume = [*ref_flags, "--use-distributed-optimizer", "--load", ckpt]
    for losses in last_stage(distributed.run(4, train, resume), count=4):
        torch.testing.assert_close(
            torch.tensor(losses),
            torch.tensor(_reference(references, case)["losses"][4:6]),
            rtol=1e-5,
            atol=0.0,
        )


def test_memory_calculator_sizes_mtp_and_a_llama_export_refuses_it(tmp_path):
    from pentatron.pretrain.arguments import ArgumentError, parse_args, validate_args
    from pentatron.pretrain.memory import plan_from_args
    from pentatron.pretrain.memory.activations import stage_activations

    args = validate_args(parse_args(DENSE), 1)
    assert stage_activations(plan_from_args(args), 0).per_microbatch.mtp > 0
    with pytest.raises(ArgumentError, match=r"^--export-hf-dir=.*mtp_num_layers=2"):
        validate_args(parse_args([*DENSE, "--export-hf-dir", str(tmp_path / "hf")]), 1)
