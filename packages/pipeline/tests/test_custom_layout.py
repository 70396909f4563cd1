"""Megatron's --pipeline-model-parallel-layout strings: parsed as Megatron-LM documents them,
turned into a StageLayout, and every broken rule refused by name."""

from __future__ import annotations

import pytest

from pentatron.pipeline import (
    PipelineConfigError,
    PipelineLayout,
    StageLayout,
    parse_layout_string,
)


def test_megatron_docs_deepseek_v3_example():
    # Megatron-LM's docs (custom pipeline layout): DeepSeek-V3, 61 layers + 1 MTP layer,
    # PP16 VPP2: rank 0 holds embedding + 3 decoder layers, then 2; ranks 1-13 2 and 2;
    # rank 14 2 and the MTP layer; rank 15 2 and the loss.
    layout = PipelineLayout.parse("Et*3|(tt|)*29,m|L", pp=16)
    assert layout.vpp == 2 and len(layout.stages) == 32
    assert layout.decoder_layers() == (3, *[2] * 29, 0, 0)
    assert layout.table().splitlines() == [
        "pp 0: E t*3 | t*2",
        "pp 1-13: t*2 | t*2",
        "pp 14: t*2 | m",
        "pp 15: t*2 | L",
    ]
    layout.check(num_layers=61, mtp_num_layers=1)
    assert layout.mtp_stage() == 30 and layout.mtp_standalone  # rank 14's second stage
    with pytest.raises(PipelineConfigError, match="1 MTP layers"):
        layout.check(num_layers=61, mtp_num_layers=None)
    beside = PipelineLayout.parse("Et*3|(tt|)*29,|mL", pp=16)
    beside.check(61, 1)
    assert beside.mtp_stage() == 31 and not beside.mtp_standalone


@pytest.mark.parametrize(
    ("text", "stages"),
    [
        ("E|(t|)*2,tL", [["E"], ["t"], ["t"], ["t", "L"]]),  # Megatron's help text form
        ("Ettt|tt*2|L", [["E", "t", "t", "t"], ["t", "t", "t"], ["L"]]),  # x*n: one letter
        ("E|(|t)*2,L", [["E"], [], ["t"], ["t", "L"]]),  # '(|ab)*2' as Megatron's comment
        ("E||t|tL", [["E"], [], ["t"], ["t", "L"]]),  # an empty stage
        ("((t|)*2t)*2", [["t"], ["t"], ["t", "t"], ["t"], ["t"]]),  # nested groups
    ],
)
def test_strings_unroll(text, stages):
    assert parse_layout_string(text) == stages


def test_list_form_takes_letters_and_megatron_names():
    a = PipelineLayout.parse([["embedding", "Decoder"], ["t", "mtp", "loss"]], pp=2)
    assert a.stages == (("E", "t"), ("t", "m", "L"))
    a.check(num_layers=2, mtp_num_layers=1)


@pytest.mark.parametrize(
    ("text", "pp", "match"),
    [
        ("Et|x|L", 3, "'x' is not a layer letter"),
        ("E(t|t|L", 3, r"'\(' is never closed"),
        ("Et)|L", 2, r"'\)' closes no"),
        ("Et*|L", 2, "followed by a count"),
        ("Et|t|L", 2, "3 stages are not a multiple of pipeline_model_parallel_size=2"),
    ],
)
def test_malformed_strings_are_refused(text, pp, match):
    with pytest.raises(PipelineConfigError, match=match) as e:
        PipelineLayout.parse(text, pp)
    assert "pipeline_model_parallel_layout=" in str(e.value) and "fix:" in str(e.value)


@pytest.mark.parametrize(
    ("text", "layers", "mtp", "match"),
    [
        ("tE|tL", 2, None, "embedding E comes first"),
        ("Et|tLL", 2, None, "loss L comes last, exactly once"),
        ("Et|tL|t|", 3, None, "loss L comes last"),
        ("Et|tL", 3, None, "2 transformer layers .t. for num_layers=3"),
        ("Et|tmL", 2, None, "1 MTP layers .m. for mtp_num_layers=None"),
        ("Et|tL", 2, 1, "0 MTP layers .m. for mtp_num_layers=1"),
        ("Etm|tL", 2, 1, "comes after the last transformer layer"),
        ("Et|t|m|||L", 2, 1, "the last virtual stage of its pipeline rank"),
        ("Et|tm|m|L", 2, 2, "every MTP layer sits in one stage"),
        ("Et|t|m|L", 2, 1, "standalone, before the loss's. on pipeline rank 0"),
    ],
)
def test_layouts_that_do_not_fit_the_model_are_refused(text, layers, mtp, match):
    with pytest.raises(PipelineConfigError, match=match):
        PipelineLayout.parse(text, 2).check(layers, mtp)


def test_stage_layers_place_layers_in_round_robin_stage_order():
    # pp2 vpp2, stages in model order: (rank 0, chunk 0), (1, 0), (0, 1), (1, 1)
    layout = StageLayout(5, 2, 2, stage_layers=(1, 2, 0, 2))
    assert [layout.layers(r, c) for c in range(2) for r in range(2)] == [
        range(0, 1),
        range(1, 3),
        range(3, 3),
        range(3, 5),
    ]
    assert layout.num_layers_to_build(0, 1) == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_layers=4, pp=2, vpp=2, stage_layers=(1, 1, 2)), "3 stages for pp=2 x vpp=2"),
        (dict(num_layers=4, pp=2, stage_layers=(1, 2)), "hold 3 layers, num_layers=4"),
        (dict(num_layers=4, pp=2, stage_layers=(5, -1)), "must be an integer >= 0"),
        (
            dict(num_layers=4, pp=2, stage_layers=(2, 2), first_stage_layers=2),
            "a custom layout already says",
        ),
        (
            dict(num_layers=4, pp=2, stage_layers=(2, 2), account_for_loss=True),
            "a custom layout already says",
        ),
        (
            dict(num_layers=4, pp=2, vpp=2, stage_layers=(1, 1, 1, 1), placement="v"),
            "a custom layout already says",
        ),
    ],
)
def test_bad_stage_layers_are_refused(kwargs, match):
    with pytest.raises(PipelineConfigError, match=match):
        StageLayout(**kwargs)
