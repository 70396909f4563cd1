"""Group rank lists, checked against the rank formula with no processes."""

from math import prod

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pentatron.parallel_state import (
    FAMILIES,
    GridLayout,
    ParallelConfig,
    ParallelConfigError,
    RankGenerator,
)
from pentatron.parallel_state.layout import DENSE_FAMILIES, EXPERT_FAMILIES


def test_worked_example():
    g = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-dp-pp")
    assert g.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.get_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.get_ranks("tp-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]


def _coords(rank, order, sizes):
    """Independent of the code under test: peel the rank formula digit by digit."""
    out = {}
    for name in order:
        out[name] = rank % sizes[name]
        rank //= sizes[name]
    return out


@st.composite
def layouts(draw):
    """A layout with world size <= 64, its order and sizes."""
    while True:
        tp, pp, cp, dp = (
            draw(st.sampled_from([1, 2, 4])),
            draw(st.sampled_from([1, 2, 4])),
            draw(st.sampled_from([1, 2])),
            draw(st.sampled_from([1, 2, 3, 4])),
        )
        world = tp * pp * cp * dp
        if world <= 64:
            break
    etp = draw(st.sampled_from([d for d in (1, 2, 4) if world // pp % d == 0]))
    ep = draw(st.sampled_from([d for d in (1, 2, 4, 8) if world // pp % (etp * d) == 0]))
    order = "-".join(draw(st.permutations(["tp", "cp", "ep", "dp"]))) + "-pp"
    return ParallelConfig(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order).resolve(world)


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_families_partition_and_match_formula(lay):
    grid = GridLayout(lay)
    world = lay.world_size
    order = lay.order.split("-")
    dense = {"tp": lay.tp, "cp": lay.cp, "ep": 1, "dp": lay.dp, "pp": lay.pp}
    expert = {"tp": lay.etp, "cp": 1, "ep": lay.ep, "dp": lay.edp, "pp": lay.pp}
    assert prod(dense.values()) == prod(expert.values()) == world
    tokens = {
        **{k: (v, dense) for k, v in DENSE_FAMILIES.items()},
        **{k: (v, expert) for k, v in EXPERT_FAMILIES.items()},
    }
    for name, (token, sizes) in tokens.items():
        groups = grid.families[name]
        assert sorted(r for g in groups for r in g) == list(range(world)), name
        dims = token.split("-")
        assert all(len(g) == prod(sizes[d] for d in dims) for g in groups), name
        for g in groups:
            cs = [_coords(r, order, sizes) for r in g]
            # members agree on every dimension outside the token...
            for d in set(order) - set(dims):
                assert len({c[d] for c in cs}) == 1, (name, d, g)
            # ...and are all distinct inside it.
            assert len({tuple(c[d] for d in dims) for c in cs}) == len(g)
    # the pipeline groups of the two grids agree (validated by GridLayout)
    assert grid.families["pp"] == grid.expert.get_ranks("pp")
    for emb, pos, pp in zip(
        grid.families["embedding"], grid.families["position-embedding"], grid.families["pp"]
    ):
        assert emb == sorted({pp[0], pp[-1]}) and pos == [pp[0]]


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_membership_lookup_is_consistent(lay):
    grid = GridLayout(lay)
    for rank in range(lay.world_size):
        for name in FAMILIES:
            group = grid.ranks(name, rank)
            if name in ("embedding", "position-embedding") and group is None:
                continue
            assert rank in group


def test_size_one_dimensions_may_be_left_out_of_order():
    a = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-dp-pp")
    b = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    for token in ("tp", "dp", "pp", "tp-dp", "dp-cp", "tp-pp"):
        assert a.get_ranks(token) == b.get_ranks(token)


def test_order_changes_groups():
    g = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-pp-dp")
    assert g.get_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_embedding_groups_take_the_named_pipeline_ranks():
    """A standalone MTP stage's embedding copy: the group holds pipeline ranks 0 and 2 of
    each pipeline group (tp2 x dp2 x pp4 = 16 ranks, pipeline groups strided by 4)."""
    lay = ParallelConfig(tp=2, pp=4, embedding_pp_ranks=(0, 2)).resolve(16)
    grid = GridLayout(lay)
    assert grid.families["pp"][0] == [0, 4, 8, 12]
    assert grid.families["embedding"][0] == [0, 8]
    assert all(len(g) == 2 for g in grid.families["embedding"])
    assert grid.ranks("embedding", 12) is None  # the last stage holds no copy here


@pytest.mark.parametrize("ranks", [(1, 2), (0, 4), (2, 0), (0, 0, 1), [0, 1]])
def test_bad_embedding_pp_ranks_are_refused(ranks):
    with pytest.raises(ParallelConfigError, match=r"embedding_pp_ranks=.*starting with 0"):
        ParallelConfig(pp=4, embedding_pp_ranks=ranks)
