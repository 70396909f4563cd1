"""Zero-bubble schedule tables (Qi et al., "Zero Bubble Pipeline Parallelism", 2401.10241).

Each backward is split into B (the input gradient, on the critical path: the previous
stage waits for it) and W (the weight gradient, needed by nobody but the optimizer). A
W can run any time after its B, so a rank can run it where 1F1B would idle.

ZB-H1 (`zb_h1_rank_schedule`): 1F1B's order of F and B (warm-up of p - 1 - r forwards on
rank r, then one forward one backward, then the cool-down backwards), with W's deferred:
rank r keeps up to r of them pending and runs the oldest as soon as more are pending,
the rest after its last B. Rank 0 defers none; the last stage, which runs its last B
first and in 1F1B would idle longest at the end of the step, defers the most. Memory: the
forwards whose B has not run are 1F1B's (p - r at most); the pending W's keep what a W
needs (each linear's input and output gradient), at most r + 1 micro-batches' worth.

With F, B, W of equal cost every rank idles p - 1 units in a step of 3m busy units, so the
bubble (idle / busy) is (p - 1) / (3m): a third of 1F1B's (p - 1) / m. Wherever
T_W <= min(T_F, T_B) it is the paper's (p - 1)(T_F + T_B - T_W) / (m (T_F + T_B + T_W));
a costlier W does not fit the gaps and leaves more idle (the tests show both).

The executor (`schedules/zero_bubble_h1.py`) runs this table; it also drives the
simulator, the timeline picture and the bubble accounting.
"""

from __future__ import annotations

from .schedule_table import Op


def zb_h1_rank_schedule(pp: int, rank: int, num_microbatches: int) -> list[Op]:
    """Every F, B (input gradient) and W (weight gradient) of rank `rank`, in order."""
    if not 0 <= rank < pp:
        raise ValueError(f"rank={rank}: the rule: 0 <= rank < pp={pp}")
    m = num_microbatches
    warm = min(pp - 1 - rank, m)
    ops = [Op("F", mb, 0) for mb in range(warm)]
    pending: list[int] = []

    def backward(mb: int) -> None:
        ops.append(Op("B", mb, 0))
        pending.append(mb)
        while len(pending) > rank:  # rank r defers up to r weight gradients
            ops.append(Op("W", pending.pop(0), 0))

    for k in range(m - warm):
        ops.append(Op("F", warm + k, 0))
        backward(k)
    for k in range(m - warm, m):
        backward(k)
    ops += [Op("W", mb, 0) for mb in pending]
    return ops


def zb_h1_bubble_fraction(
    pp: int,
    num_microbatches: int,
    forward_cost: float = 1.0,
    backward_cost: float = 1.0,
    weight_cost: float = 1.0,
) -> float:
    """The paper's ZB-H1 bubble, idle / busy: (p-1)(F + B - W) / (m (F + B + W)); with
    equal costs (p-1)/(3m). `zb_h1_rank_schedule` reaches it when W <= min(F, B)."""
    f, b, w = forward_cost, backward_cost, weight_cost
    return (pp - 1) * max(f + b - w, 0.0) / (num_microbatches * (f + b + w))


def peak_in_flight(ops: list[Op]) -> tuple[int, int]:
    """(most forwards whose B has not run, most B's whose W has not run) along `ops`."""
    forwards = weights = peak_f = peak_w = 0
    for op in ops:
        if op.kind == "F":
            forwards += 1
            peak_f = max(peak_f, forwards)
        elif op.kind == "B":
            forwards -= 1
            weights += 1
            peak_w = max(peak_w, weights)
        elif op.kind == "W":
            weights -= 1
    return peak_f, peak_w
