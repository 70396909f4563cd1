"""Stage layout and configuration: right splits, and clear errors for impossible ones."""

from __future__ import annotations

import pytest
import torch

from pentatron.pipeline import PipelineConfig, PipelineConfigError, StageLayout, check_schedule
from pentatron.pipeline.config import tensor_shape


def _all_layers(layout: StageLayout) -> list[int]:
    out = []
    for s in range(layout.pp * layout.chunks):  # virtual stage order
        out += list(layout.layers(s % layout.pp, s // layout.pp))
    return out


@pytest.mark.parametrize(("L", "p", "v"), [(8, 2, None), (8, 4, 2), (12, 2, 3), (16, 4, 4)])
def test_even_split_round_robin(L, p, v):
    layout = StageLayout(L, p, v)
    assert _all_layers(layout) == list(range(L))
    per = L // (p * (v or 1))
    assert layout.layers(1, 0) == range(per, 2 * per)  # chunk 0 of rank 1 follows rank 0's
    if v:
        assert layout.layers(0, 1) == range(p * per, (p + 1) * per)


def test_uneven_first_last_and_embedding_loss_slots():
    layout = StageLayout(10, 4, first_stage_layers=1, last_stage_layers=3)
    assert [len(layout.layers(r)) for r in range(4)] == [1, 3, 3, 3]
    layout = StageLayout(12, 4, 2, first_stage_layers=2, last_stage_layers=2)
    assert [layout.num_layers_to_build(r, c) for c in range(2) for r in range(4)] == [
        1,
        2,
        2,
        1,
        1,
        2,
        2,
        1,
    ]
    assert _all_layers(layout) == list(range(12))
    layout = StageLayout(6, 4, account_for_embedding=True, account_for_loss=True)  # 8 slots
    assert [len(layout.layers(r)) for r in range(4)] == [1, 2, 2, 1]
    assert _all_layers(layout) == list(range(6))


@pytest.mark.parametrize("p", [2, 3, 4])
def test_v_placement(p):
    """ZBV's V, written out: rank r's chunk 0 holds layers 2r, 2r + 1 on the way down,
    its chunk 1 the mirror on the way up; rank 0 the first and the last layers."""
    L = 4 * p
    layout = StageLayout(L, p, 2, placement="v")
    for r in range(p):
        assert layout.layers(r, 0) == range(2 * r, 2 * r + 2)
        assert layout.layers(r, 1) == range(L - 2 * r - 2, L - 2 * r)
        for c in range(2):
            assert layout.position(layout.stage(r, c)) == (r, c)
    # The embedding's and the loss's slots both fall on rank 0 (its two chunks).
    slots = StageLayout(4 * p - 2, p, 2, placement="v", account_for_embedding=True,
                        account_for_loss=True)  # fmt: skip
    assert [slots.num_layers_to_build(0, c) for c in range(2)] == [1, 1]
    assert [slots.num_layers_to_build(r, c) for r in range(1, p) for c in range(2)] == [2] * (
        2 * p - 2
    )
    stages = [slots.layers(*slots.position(s)) for s in range(2 * p)]
    assert [i for st in stages for i in st] == list(range(4 * p - 2))


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(num_layers=8, pp=2, vpp=4, placement="v"), ["placement='v'", "vpp=4", "fix"]),
        (dict(num_layers=8, pp=2, vpp=2, placement="v", first_stage_layers=2), ["even split"]),
        (dict(num_layers=8, pp=2, placement="zig"), ["'loop'", "'v'"]),
        (dict(num_layers=10, pp=4), ["num_layers=10", "pp=4", "fix"]),
        (dict(num_layers=8, pp=2, vpp=3), ["vpp=3", "fix"]),
        (
            dict(num_layers=7, pp=4, account_for_embedding=True, account_for_loss=True),
            ["(+1 embedding)", "9", "pp=4"],
        ),
        (
            dict(num_layers=10, pp=4, first_stage_layers=2, last_stage_layers=3),
            ["5 layers remain", "2 middle"],
        ),
        (dict(num_layers=8, pp=2, vpp=2, first_stage_layers=3), ["first_stage_layers=3", "vpp=2"]),
        (dict(num_layers=8, pp=2, first_stage_layers=2, account_for_loss=True), ["one of the two"]),
        (dict(num_layers=0, pp=2), ["num_layers=0"]),
    ],
)
def test_impossible_layouts(kwargs, words):
    with pytest.raises(PipelineConfigError) as info:
        StageLayout(**kwargs)
    for w in words:
        assert w in str(info.value)


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (dict(pp=4, vpp=2, num_microbatches=3), ["pp <= group size <= num_microbatches", "fix"]),
        (dict(pp=4, vpp=2, num_microbatches=6), ["last group of 2 < pp=4", "fix"]),
        (dict(pp=1, vpp=2, num_microbatches=4), ["vpp=2 with pp=1"]),
        (dict(pp=2, vpp=None, num_microbatches=0), ["num_microbatches=0"]),
        (dict(pp=2, vpp=None, num_microbatches=4, seq_length=6, tp=4), ["seq_length=6", "cp*tp"]),
    ],
)
def test_bad_schedule_calls(call, words):
    config = PipelineConfig(hidden_size=4, sequence_parallel=True)
    with pytest.raises(PipelineConfigError) as info:
        check_schedule(config, **call)
    for w in words:
        assert w in str(info.value)


def test_config_rules():
    with pytest.raises(PipelineConfigError, match="overlap_p2p_comm=True with batch_p2p_comm"):
        PipelineConfig(hidden_size=4, overlap_p2p_comm=True)
    with pytest.raises(PipelineConfigError, match="without interleaving"):
        check_schedule(
            PipelineConfig(hidden_size=4, overlap_p2p_comm=True, batch_p2p_comm=False),
            pp=2,
            vpp=None,
            num_microbatches=4,
        )
    with pytest.raises(PipelineConfigError, match="hidden_size"):
        PipelineConfig(hidden_size=0)
    with pytest.raises(PipelineConfigError, match="pipeline_dtype"):
        PipelineConfig(hidden_size=2, pipeline_dtype="fp16")
    sp = PipelineConfig(hidden_size=16, sequence_parallel=True, pipeline_dtype=torch.bfloat16)
    assert tensor_shape(sp, 32, 2, tp=4, cp=2) == (4, 2, 16)  # s / cp / tp
    assert tensor_shape(PipelineConfig(hidden_size=16), 32, 2, tp=4, cp=2) == (16, 2, 16)
