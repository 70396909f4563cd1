"""Multi-latent attention through the app (Megatron's flags): 6 steps of a DeepSeek-like
tiny model (MLA with a q latent and the latent norms, a dense first layer then MoE layers
with a shared expert) give the losses and grad norms (before clipping, every rank) of one
process at tp2-pp2-dp2 with SP and the distributed optimizer, at tp2-ep2 with SP, and at
cp2-tp2 with SP (a2a; the cp kernels carry V zero-padded to q/k's head dim) (fp32, rtol
1e-6: the order of sums only). A checkpoint saved at tp2-pp2-dp2 resumes at
tp1-pp1-dp4 with the same next losses (the up-projections reshard like any column, the
duplicated down-projections are whole on every rank)."""

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
    resumed_losses,
    train_record,
)

MLA = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12"]
MLA += ["--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8"]
MLA += ["--qk-layernorm", "--transformer-impl", "local"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]
MOE += ["--moe-layer-freq", "[0,1,1,1]", "--moe-shared-expert-intermediate-size", "32"]
MOE += ["--moe-aux-loss-coeff", "0.01"]
COMMON = [*TINY_GPT, *MLA, *MOE, "--train-iters", "6", "--seed", "9"]
LAYOUTS = {
    "tp2-pp2-dp2-sp-distopt": [*TP2_PP2, "--sequence-parallel", "--use-distributed-optimizer"],
    "tp2-ep2-sp": [
        "--tensor-model-parallel-size",
        "2",
        "--expert-model-parallel-size",
        "2",
        "--sequence-parallel",
    ],
    "cp2-tp2-sp-a2a": [
        "--context-parallel-size",
        "2",
        "--cp-comm-type",
        "a2a",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
    ],
}


@pytest.fixture(scope="module")
def reference(distributed):
    return distributed.run(1, train_record, COMMON)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mla_moe_losses_and_grad_norms_match_one_process(distributed, reference, layout):
    assert reference["losses"][-1] < reference["losses"][0]  # it learns
    world = 8 if "pp2" in layout else 4
    per_rank = distributed.run(world, train_record, COMMON + LAYOUTS[layout])
    assert_matches_reference(per_rank, reference, 1e-6)


def test_aux_loss_grads_not_scaled_by_cp_are_caught(distributed, reference):
    """Planted: the MoE aux-loss grad without the cp factor (DDP averages over cp; the aux
    losses are shares that add up over it): the cp2 grad norms differ (they did, by 0.2%,
    before the factor was added)."""
    argv = COMMON + LAYOUTS["cp2-tp2-sp-a2a"] + ["--exit-interval", "2"]
    per_rank = distributed.run(4, train_record, argv, "aux_loss_without_cp")
    with pytest.raises(AssertionError, match="grad norms"):
        assert_matches_reference(per_rank, first_steps(reference, 2), 1e-6)


def test_mla_checkpoint_resumes_at_another_layout(distributed, reference, tmp_path):
    layout = LAYOUTS["tp2-pp2-dp2-sp-distopt"]
    for losses in resumed_losses(distributed, COMMON, layout, str(tmp_path / "ckpt")):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(reference["losses"][3:5]), rtol=1e-5, atol=0.0
        )


def test_memory_calculator_sizes_mla_with_and_without_cp():
    """The app's MLA flags size at cp 1 and, since pretrain 0.11.2, with cp (the padded V:
    the core attention's terms at d_q dims, exact in test_memory_measure's mla-cp2-*)."""
    from pentatron.pretrain.arguments import parse_args, validate_args
    from pentatron.pretrain.memory import plan_from_args
    from pentatron.pretrain.memory.activations import stage_activations

    args = validate_args(parse_args(COMMON), 1)
    one = stage_activations(plan_from_args(args), 0).per_microbatch
    assert one.attention > 0
    cp = ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"]
    args = validate_args(parse_args([*COMMON, *cp, "--sequence-parallel"]), 4)
    two = stage_activations(plan_from_args(args), 0).per_microbatch
    assert two.core_attention > 0 and two.total < one.total


def test_yarn_flags_reach_the_model_and_misuse_is_refused():
    """Megatron's YaRN flags (MLA takes YaRN unless --rope-type rope); None = its defaults."""
    from pentatron.pretrain.arguments import ArgumentError, parse_args, validate_args
    from pentatron.pretrain.training.configs import transformer_config

    yarn = ["--rotary-scaling-factor", "40", "--mscale", "0.9", "--mscale-all-dim", "1.0"]
    config = transformer_config(validate_args(parse_args([*COMMON, *yarn]), 1))
    assert (config.rotary_scaling_factor, config.mscale, config.mscale_all_dim) == (40, 0.9, 1)
    assert config.yarn_original_max_position_embeddings == 4096  # MLATransformerConfig's
    assert (config.yarn_beta_fast, config.yarn_beta_slow) == (32.0, 1.0)
    given = [*yarn, "--yarn-original-max-position-embeddings", "512", "--yarn-beta-fast", "16"]
    given += ["--no-yarn-correction-range-round-to-int"]
    config = transformer_config(validate_args(parse_args([*COMMON, *given]), 1))
    assert config.yarn_original_max_position_embeddings == 512
    assert config.yarn_beta_fast == 16.0 and not config.yarn_correction_range_round_to_int
    with pytest.raises(ArgumentError, match=r"^--rotary-scaling-factor=40.0: .*--rope-type rope"):
        validate_args(parse_args([*COMMON, *yarn, "--rope-type", "rope"]), 1)
    with pytest.raises(ArgumentError, match=r"^--rope-type=yarn: "):
        validate_args(parse_args([*TINY_GPT, "--train-iters", "2", "--rope-type", "yarn"]), 1)
