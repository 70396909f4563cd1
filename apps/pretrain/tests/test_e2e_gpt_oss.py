"""gpt-oss through the app, with the flags of Megatron's examples/gptoss/02_train.sh:
learnable softmax sinks, a sliding window (3 keys back here, on layers 1 and 3: every second
layer full), quick-GeGLU with the linear offset 1 and a clamp, YaRN RoPE, MoE (with the
router's logit bias) and the alltoall dispatcher. 6 steps at tp2-pp2-dp2 with SP and the distributed optimizer give one process's
losses and grad norms (before clipping, every rank; fp32, rtol 1e-6: the order of sums
only); a checkpoint saved there resumes at tp1-pp1-dp4 with the next losses (the sinks
reshard by heads). The memory calculator sizes the run (its bytes are measured exact in
test_memory_measure, with and without context parallelism)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _app import TINY_GPT, TP2_PP2, assert_matches_reference, resumed_losses, train_record

GPT_OSS = ["--softmax-type", "learnable", "--window-size", "3,0", "--window-attn-skip-freq", "2"]
GPT_OSS += ["--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "0.5"]
# YaRN on standard attention (gpt-oss: x32 over 4096 positions): x4 over 8 of the 16 here
GPT_OSS += ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4"]
GPT_OSS += [
    "--yarn-original-max-position-embeddings",
    "8",
    "--no-yarn-correction-range-round-to-int",
]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]
MOE += ["--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0.01"]
COMMON = [f for f in TINY_GPT if f != "--swiglu"] + GPT_OSS + MOE
COMMON += ["--transformer-impl", "local", "--train-iters", "6", "--seed", "5"]
LAYOUT = [*TP2_PP2, "--sequence-parallel", "--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def reference(distributed):
    return distributed.run(1, train_record, COMMON)[0]


def test_gpt_oss_losses_and_grad_norms_match_one_process(distributed, reference):
    assert reference["losses"][-1] < reference["losses"][0]  # it learns
    per_rank = distributed.run(8, train_record, COMMON + LAYOUT)
    assert_matches_reference(per_rank, reference, 1e-6)


def test_gpt_oss_checkpoint_resumes_at_another_layout(distributed, reference, tmp_path):
    for losses in resumed_losses(distributed, COMMON, LAYOUT, str(tmp_path / "ckpt")):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(reference["losses"][3:5]), rtol=1e-6, atol=0.0
        )


def test_memory_calculator_sizes_the_variants_at_every_cp_kind():
    """Sized at cp 1 and at cp2 of each kind (the bytes are measured exact in
    test_memory_measure): the ring and all-gather keep their blockwise maths' few [s/cp]
    tensors, a2a the sinks' padded SDPA inputs over the whole sequence for half the heads."""
    from pentatron.pretrain.arguments import parse_args, validate_args
    from pentatron.pretrain.memory import plan_from_args
    from pentatron.pretrain.memory.activations import stage_activations

    def core(extra: list[str], world: int) -> int:
        plan = plan_from_args(validate_args(parse_args(COMMON + extra), world))
        return stage_activations(plan, 0).per_microbatch.core_attention

    cp2 = ["--context-parallel-size", "2", "--cp-comm-type"]
    sizes = [core([], 1), *(core([*cp2, kind], 2) for kind in ("a2a", "p2p", "all_gather"))]
    assert sizes[2] == sizes[3] < sizes[1] < sizes[0]
