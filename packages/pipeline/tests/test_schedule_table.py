"""The schedule table and per-rank order against closed forms written independently."""

from __future__ import annotations

import os
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))

from test_schedules import expected_ops, expected_table

from pentatron.pipeline import get_schedule_table, phase_counts, rank_schedule


def test_megatron_documented_example():
    # Megatron-LM's comment: PP2, N3 (group), M5, VP2.
    table = get_schedule_table(5, 2, 3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


@settings(max_examples=200, deadline=None)
@given(m=st.integers(1, 40), v=st.integers(1, 5), g=st.integers(1, 12))
def test_table_closed_form(m, v, g):
    assert get_schedule_table(m, v, g) == expected_table(m, v, g)


@st.composite
def layouts(draw):
    p = draw(st.integers(2, 8))
    v = draw(st.one_of(st.none(), st.integers(2, 4)))
    if v is None:
        return p, None, None, draw(st.integers(1, 4 * p))
    g = draw(st.integers(p, 3 * p))
    m = draw(st.integers(g, 4 * g))
    if 0 < m % g < p:
        m += p - m % g  # Megatron's rule: remainder 0 or >= p
    return p, v, g, m


@settings(max_examples=200, deadline=None)
@given(layout=layouts(), forward_only=st.booleans())
def test_rank_order_closed_form(layout, forward_only):
    p, v, g, m = layout
    for r in range(p):
        ops = [(o.kind, o.microbatch, o.chunk) for o in rank_schedule(p, r, m, v, g, forward_only)]
        assert ops == expected_ops(p, r, m, v, g, forward_only)
        # every (micro-batch, chunk) is run forward once and (training) backward once
        vv = v or 1
        assert sorted(o for o in ops if o[0] == "F") == sorted(
            ("F", mb, c) for mb in range(m) for c in range(vv)
        )
        if not forward_only:
            assert sorted(o for o in ops if o[0] == "B") == sorted(
                ("B", mb, c) for mb in range(m) for c in range(vv)
            )


def test_phase_counts_1f1b():
    assert phase_counts(4, 0, 8) == {"warmup": 3, "steady": 5, "cooldown": 3}
    assert phase_counts(4, 3, 8) == {"warmup": 0, "steady": 8, "cooldown": 0}
    assert phase_counts(4, 0, 2) == {"warmup": 2, "steady": 0, "cooldown": 2}
    # interleaved p=4, v=2, group 4, rank 0: (4-0-1)*2 + (2-1)*4 = 10 of 16
    assert phase_counts(4, 0, 8, 2)["warmup"] == 10
