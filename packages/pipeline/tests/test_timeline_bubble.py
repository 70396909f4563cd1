"""Simulator and bubble accounting against the closed forms; trace, PNG and CLI output."""

from __future__ import annotations

import json
import struct
from fractions import Fraction

import pytest

from pentatron.pipeline import Op, ScheduleDeadlock, bubble_report, simulate, simulate_ops
from pentatron.pipeline.cli import main
from pentatron.pipeline.render import render_png
from pentatron.pipeline.timeline import to_chrome_trace

ONE_F_ONE_B = [(p, m) for p in (2, 3, 4, 8) for m in (1, 2, p - 1, p, 2 * p, 3 * p + 1) if m >= 1]
INTERLEAVED = [(p, v, m) for p in (2, 4) for v in (2, 3) for m in (p, 2 * p, 3 * p, 4 * p)]


@pytest.mark.parametrize(("p", "m"), ONE_F_ONE_B)
def test_1f1b_bubble_exact(p, m):
    report = bubble_report(simulate(p, m, forward_cost=1, backward_cost=2))
    # makespan (m + p - 1) * (F + B); each rank busy m * (F + B)
    assert Fraction(report.makespan) == 3 * (m + p - 1)
    assert Fraction(report.bubble_fraction).limit_denominator(10**6) == Fraction(p - 1, m)
    assert Fraction(report.bubble_share).limit_denominator(10**6) == Fraction(p - 1, m + p - 1)


@pytest.mark.parametrize(("p", "v", "m"), INTERLEAVED)
def test_interleaved_bubble_exact(p, v, m):
    report = bubble_report(simulate(p, m, v, forward_cost=1, backward_cost=2))
    assert Fraction(report.bubble_fraction).limit_denominator(10**6) == Fraction(p - 1, v * m)
    assert Fraction(report.bubble_share).limit_denominator(10**6) == Fraction(p - 1, v * m + p - 1)


def test_p2p_cost_grows_the_bubble_and_forward_only_has_no_backward():
    free = bubble_report(simulate(4, 8, p2p_cost=0)).makespan
    assert bubble_report(simulate(4, 8, p2p_cost=0.5)).makespan > free
    events = simulate(4, 8, forward_only=True)
    assert {e.kind for e in events} == {"forward"}
    assert bubble_report(events).makespan == 8 + 3  # m forwards, plus p - 1 of fill


def test_infeasible_order_is_reported():
    # rank 0 wants the backward of micro-batch 0 before rank 1 ever runs its forward
    ops = [[Op("F", 0, 0), Op("B", 0, 0)], [Op("B", 0, 0), Op("F", 0, 0)]]
    with pytest.raises(ScheduleDeadlock, match="no rank can proceed"):
        simulate_ops(ops)


def test_chrome_trace_and_png(tmp_path):
    events = simulate(4, 8, 2)
    trace = to_chrome_trace(events)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 4 * 8 * 2 * 2 and {e["tid"] for e in spans} == {0, 1, 2, 3}
    assert {e["name"] for e in spans if e["tid"] == 0} >= {"F0.c0", "B7.c1"}
    png = render_png(events, tmp_path / "t.png", use_matplotlib=False).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width == round(bubble_report(events).makespan * 12) and height == 4 * 28 + 4


def test_cli(tmp_path, capsys):
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    assert (
        main(
            ["--pp", "4", "--vpp", "2", "-m", "8", "--png", str(png), "--chrome-trace", str(trace)]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "bubble fraction (idle/busy) 0.1875" in out  # (4-1)/(2*8)
    assert png.read_bytes()[:4] == b"\x89PNG" and json.loads(trace.read_text())["traceEvents"]
    with pytest.raises(Exception, match="last group of 2"):
        main(["--pp", "4", "--vpp", "2", "-m", "6"])
