"""Megatron's pipeline-split flags: --pipeline-model-parallel-layout, --num-virtual-stages-
per-pipeline-rank, --account-for-embedding/loss-in-pipeline-split. Each reaches the model
config (the layers every (pp rank, chunk) builds, written out by hand here), and each
combination Megatron-LM refuses fails before any process group, naming the flag."""

from __future__ import annotations

import os
import sys

import pytest

from pentatron.pretrain.arguments import ArgumentError, parse_args, validate_args
from pentatron.pretrain.training import configs

sys.path.insert(0, os.path.dirname(__file__))
from test_arguments import BASE


def _validated(extra, world):
    return validate_args(parse_args(BASE + extra), world)


def _built(args) -> dict[int, list[list[int]]]:
    """pp rank -> the global layers of each of its chunks, from the model config."""
    layout = configs.transformer_config(args).stage_layout()
    return {r: [list(layout.layers(r, c)) for c in range(layout.chunks)] for r in range(layout.pp)}


def _pp(n: int) -> list[str]:
    return ["--pipeline-model-parallel-size", str(n), "--global-batch-size", str(2 * n)]


# (flags, pp, vpp after validation, pp rank -> layers of each chunk). Stage s of a layout
# is chunk s // pp of rank s % pp; the accounted splits give the first / last stage one
# layer fewer.
SPLITS = {
    "layout-pp2": (
        ["--pipeline-model-parallel-layout", "Ettt|(tt|)*2,tL"],  # 3 | 2 | 2 | 1
        2,
        2,
        {0: [[0, 1, 2], [5, 6]], 1: [[3, 4], [7]]},
    ),
    "layout-empty-stages": (
        ["--pipeline-model-parallel-layout", "E|t*3|tt||ttt|L"],  # 0 | 3 | 2 | 0 | 3 | 0
        2,
        3,
        {0: [[], [3, 4], [5, 6, 7]], 1: [[0, 1, 2], [], []]},
    ),
    "layout-one-stage-per-rank": (
        ["--pipeline-model-parallel-layout", "Ett|t*6L"],
        2,
        None,
        {0: [[0, 1]], 1: [[2, 3, 4, 5, 6, 7]]},
    ),
    "accounted-embedding": (
        ["--account-for-embedding-in-pipeline-split"],  # 9 slots over 3 ranks
        3,
        None,
        {0: [[0, 1]], 1: [[2, 3, 4]], 2: [[5, 6, 7]]},
    ),
    "accounted-both-vpp5": (
        [
            "--account-for-embedding-in-pipeline-split",
            "--account-for-loss-in-pipeline-split",
            "--num-virtual-stages-per-pipeline-rank",
            "5",
        ],  # 10 slots, one per stage: stage s holds layer s - 1
        2,
        5,
        {0: [[], [1], [3], [5], [7]], 1: [[0], [2], [4], [6], []]},
    ),
    "accounted-loss-per-virtual-stage": (
        [
            "--account-for-loss-in-pipeline-split",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
        ],  # 9 slots over pp3 x 3 stages
        3,
        3,
        {0: [[0], [3], [6]], 1: [[1], [4], [7]], 2: [[2], [5], []]},
    ),
}


@pytest.mark.parametrize("name", list(SPLITS))
def test_split_flags_reach_the_model(name):
    flags, pp, vpp, built = SPLITS[name]
    args = _validated([*_pp(pp), *flags], pp)
    assert args.virtual_pipeline_model_parallel_size == vpp
    assert _built(args) == built


def test_layout_is_named_at_start_up():
    args = _validated([*_pp(2), "--pipeline-model-parallel-layout", "Ettt|(tt|)*2,tL"], 2)
    notes = [n for n in args.startup_notes if n.startswith("--pipeline-model-parallel-layout")]
    assert notes == [
        "--pipeline-model-parallel-layout Ettt|(tt|)*2,tL: pp 0: E t*3 | t*2; pp 1: t*2 | t L"
    ]


DSV3 = "Et*3|(tt|)*29,m|L"  # Megatron-LM's documented DeepSeek-V3 layout (PP16 VPP2)


@pytest.mark.parametrize(
    ("extra", "pp", "match"),
    [
        (
            [
                "--pipeline-model-parallel-layout",
                "Et|ttt||L",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
            ],
            2,
            "--pipeline-model-parallel-layout=Et|ttt||L: exclusive with "
            "--num-layers-per-virtual-pipeline-stage",
        ),
        (
            [
                "--pipeline-model-parallel-layout",
                "Ettt|ttttt|L",
                "--decoder-first-pipeline-num-layers",
                "3",
            ],
            3,
            "--decoder-first-pipeline-num-layers=3: --pipeline-model-parallel-layout already",
        ),
        (
            [
                "--pipeline-model-parallel-layout",
                "Et|ttt||ttttL",
                "--account-for-loss-in-pipeline-split",
            ],
            2,
            "--account-for-loss-in-pipeline-split=True: --pipeline-model-parallel-layout",
        ),
        (
            ["--pipeline-model-parallel-layout", "Et|ttt||ttL"],
            2,
            "6 transformer layers .t. for --num-layers 8; fix: write 8 t's",
        ),
        (
            ["--pipeline-model-parallel-layout", "Et|tt|ttttL"],
            2,
            "3 stages are not a multiple of --pipeline-model-parallel-size 2",
        ),
        (
            [
                "--pipeline-model-parallel-layout",
                "Et|ttt||ttttL",
                "--virtual-pipeline-model-parallel-size",
                "3",
            ],
            2,
            "--virtual-pipeline-model-parallel-size=3: disagrees with "
            "--pipeline-model-parallel-layout .2 stages per rank.",
        ),
        (
            ["--pipeline-model-parallel-layout", "Etttt|ttttL"],
            1,
            "2 stages need --pipeline-model-parallel-size > 1",
        ),
        (
            [
                "--pipeline-model-parallel-layout",
                "Etttt|ttttL",
                "--pipeline-schedule",
                "zbv",
                "--untie-embeddings-and-output-weights",
            ],
            2,
            "--pipeline-model-parallel-layout=Etttt|ttttL: with --pipeline-schedule zbv",
        ),
        (
            [
                "--num-layers",
                "61",
                "--mtp-num-layers",
                "1",
                "--pipeline-model-parallel-layout",
                DSV3,
            ],
            16,
            "a standalone MTP stage .its m's in a stage before L's. with tied embeddings.*fix: "
            "add --untie-embeddings-and-output-weights",
        ),
        (
            [
                "--account-for-embedding-in-pipeline-split",
                "--decoder-first-pipeline-num-layers",
                "3",
            ],
            2,
            "--account-for-embedding-in-pipeline-split=True: an uneven split",
        ),
        (
            ["--account-for-embedding-in-pipeline-split"],
            2,
            r"--num-layers=8: 9 layers \(\+1 embedding\) must be divisible by pp\*vpp = 2\*1",
        ),
        (
            ["--account-for-loss-in-pipeline-split"],
            1,
            "--account-for-loss-in-pipeline-split=True: with pp=1",
        ),
        (
            ["--num-virtual-stages-per-pipeline-rank", "2"],
            1,
            "--num-virtual-stages-per-pipeline-rank=2: virtual stages need",
        ),
        (
            [
                "--num-layers-per-virtual-pipeline-stage",
                "1",
                "--decoder-last-pipeline-num-layers",
                "2",
            ],
            2,
            "pass --num-virtual-stages-per-pipeline-rank instead",
        ),
    ],
)
def test_splits_megatron_refuses_fail_naming_the_flag(extra, pp, match):
    with pytest.raises(ArgumentError, match=match):
        _validated([*_pp(pp), *extra], pp)


def test_megatron_docs_layout_runs_with_the_mtp_layer_beside_the_loss():
    args = _validated(
        [
            "--num-layers",
            "61",
            "--mtp-num-layers",
            "1",
            "--pipeline-model-parallel-layout",
            "Et*3|(tt|)*29,|mL",
            *_pp(16),
        ],
        16,
    )
    assert args.virtual_pipeline_model_parallel_size == 2
    built = _built(args)
    # stage 0 (rank 0, chunk 0) holds layers 0-2, stages 1-29 two each: stage 15 (rank 15,
    # chunk 0) layers 31-32, stage 16 (rank 0, chunk 1) 33-34; stage 31 (rank 15, chunk 1)
    # holds only the MTP layer and the loss
    assert built[0] == [[0, 1, 2], [33, 34]] and built[15] == [[31, 32], []]
    assert sum(len(c) for chunks in built.values() for c in chunks) == 61


def test_megatron_docs_layout_runs_with_a_standalone_mtp_stage():
    """Megatron's documented DeepSeek-V3 layout, as its recipe runs it (untied embeddings):
    the MTP layer on pipeline rank 14's second stage, which joins the embedding group and
    sends (1 + D) s rows to the loss's stage (variable-length messages)."""
    args = _validated(
        [
            *("--num-layers", "61", "--mtp-num-layers", "1"),
            *("--untie-embeddings-and-output-weights", "--pipeline-model-parallel-layout", DSV3),
            *_pp(16),
        ],
        16,
    )
    assert args.virtual_pipeline_model_parallel_size == 2
    assert configs.standalone_mtp_rank(args) == 14
    assert configs.parallel_config(args).embedding_pp_ranks == (0, 14)
    assert configs.pipeline_config(args).variable_seq_lengths
    model = configs.transformer_config(args)
    assert model.mtp_standalone
    assert [r for r in range(16) for c in (0, 1) if model.mtp_on(r, c, False)] == [14]
    assert model.final_norm_on(14, 1, False) and not model.final_norm_on(15, 1, True)


@pytest.mark.parametrize(
    ("extra", "overlap"),
    [
        (["--num-virtual-stages-per-pipeline-rank", "2"], True),  # Megatron's default
        (["--num-virtual-stages-per-pipeline-rank", "2", "--no-overlap-p2p-communication"], False),
        ([], False),  # 1F1B: only the interleaved schedule overlaps
        (["--pipeline-schedule", "zb-h1"], False),
    ],
)
def test_interleaved_p2p_overlaps_unless_told_not_to(extra, overlap):
    """Megatron's --no-overlap-p2p-communication: overlap (single sends and receives) for
    the interleaved schedule by default, else batched p2p (batch_p2p_comm = not overlap)."""
    pcfg = configs.pipeline_config(_validated([*_pp(2), *extra], 2))
    assert (pcfg.overlap_p2p_comm, pcfg.batch_p2p_comm) == (overlap, not overlap)
