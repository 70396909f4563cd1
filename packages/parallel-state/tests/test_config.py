"""Bad layouts fail with a message naming the field, the rule and a fix."""

from datetime import timedelta

import pytest
import torch.distributed as dist

from pentatron.parallel_state import ParallelConfig, ParallelConfigError, initialize_model_parallel


@pytest.mark.parametrize(
    ("kwargs", "world", "words"),
    [
        (dict(tp=3), 8, ["world_size=8", "tp*cp*pp", "fix"]),
        (dict(tp=2, pp=3), 8, ["world_size=8", "tp*cp*pp", "6"]),
        (dict(tp=2, ep=3), 8, ["etp*ep*pp", "world_size=8", "fix"]),
        (dict(tp=1, etp=4, ep=4), 8, ["etp*ep*pp", "16"]),
        (dict(tp=2, dp=3), 8, ["dp=3", "fix"]),
    ],
)
def test_world_size_mismatch(kwargs, world, words):
    with pytest.raises(ParallelConfigError) as info:
        ParallelConfig(**kwargs).resolve(world)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(order="tp-xp-dp-pp"), ["order=", "'xp'", "unknown"]),
        (dict(order="tp-dp-tp-pp"), ["order=", "tp", "repeated"]),
        (dict(order="tp-dp-pp", cp=2), ["lacks 'cp'", "cp=2"]),
        (dict(vpp=2), ["vpp=2", "pp=1", "fix"]),
        (dict(tp=0), ["tp=0", "positive"]),
        (dict(timeout=timedelta(0)), ["timeout", "positive"]),
    ],
)
def test_bad_fields(kwargs, words):
    with pytest.raises(ParallelConfigError) as info:
        ParallelConfig(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_resolve_derives_dp_and_edp():
    lay = ParallelConfig(tp=2, pp=2, ep=2, etp=1).resolve(16)
    assert (lay.dp, lay.edp, lay.etp) == (4, 4, 1)
    assert ParallelConfig(tp=4).resolve(8).etp == 4  # etp defaults to tp


def test_expert_and_dense_pipeline_groups_must_agree():
    from pentatron.parallel_state import GridLayout

    # pp not last and etp*ep != tp*cp: the two grids would disagree on pipeline groups.
    layout = ParallelConfig(tp=2, pp=2, ep=4, etp=1, order="tp-pp-ep-dp").resolve(8)
    with pytest.raises(ParallelConfigError, match="pipeline groups"):
        _ = GridLayout(layout).families


def _bad_init(kwargs):
    before = len(dist.distributed_c10d._world.pg_map)
    try:
        initialize_model_parallel(ParallelConfig(**kwargs))
    except ParallelConfigError as exc:
        return str(exc), len(dist.distributed_c10d._world.pg_map) - before
    return None, len(dist.distributed_c10d._world.pg_map) - before


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        (dict(tp=3), "world_size=8"),
        (dict(tp=2, ep=3), "etp*ep*pp"),
        (dict(tp=2, pp=2, ep=4, etp=1, order="tp-pp-ep-dp"), "pipeline groups"),
    ],
)
def test_bad_layout_fails_on_every_rank_before_any_group(distributed, kwargs, word):
    results = distributed.run(8, _bad_init, kwargs)
    assert all(msg is not None and word in msg for msg, _ in results), results
    assert all(created == 0 for _, created in results)


@pytest.mark.parametrize(
    ("sizes", "words"),
    [
        ((2, 3), ["hierarchical_cp=(2, 3)", "cp=4", "multiply to cp", "fix"]),
        ((), ["non-empty tuple", "fix"]),
        ([2, 2], ["non-empty tuple"]),
        ((4, 0), ["hierarchical_cp entry=0", "positive"]),
    ],
)
def test_bad_hierarchical_cp(sizes, words):
    with pytest.raises(ParallelConfigError) as info:
        ParallelConfig(cp=4, hierarchical_cp=sizes)
    for word in words:
        assert word in str(info.value)


def test_hierarchical_cp_rank_lists_follow_megatron():
    """Megatron's create_hierarchical_groups, written out for the test: level 0 joins
    consecutive members of each cp group, level 1 members a level-0 size apart."""
    from pentatron.parallel_state import GridLayout

    grid = GridLayout(ParallelConfig(tp=2, cp=4, hierarchical_cp=(2, 2)).resolve(8))
    assert grid.families["cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid.hierarchical_cp == [
        [[0, 2], [4, 6], [1, 3], [5, 7]],
        [[0, 4], [2, 6], [1, 5], [3, 7]],
    ]
    three = GridLayout(ParallelConfig(cp=8, hierarchical_cp=(2, 2, 2)).resolve(8))
    assert three.hierarchical_cp[2] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert three.hierarchical_cp[1] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # every level's groups partition the world, and one group of each level meets the
    # others' in exactly one rank (the levels are the axes of a grid over the cp group)
    for level in three.hierarchical_cp:
        assert sorted(r for g in level for r in g) == list(range(8))
    assert GridLayout(ParallelConfig(cp=2).resolve(2)).hierarchical_cp == []
