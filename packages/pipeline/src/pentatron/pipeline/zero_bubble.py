"""Zero-bubble schedule tables (Qi et al., "Zero Bubble Pipeline Parallelism", 2401.10241).

Each backward is split into B (the input gradient, on the critical path: the previous
stage waits for it) and W (the weight gradient, needed by nobody but the optimizer). A
W can run any time after its B, so a rank can run it where 1F1B would idle.

ZBV (`zbv_schedules`): two chunks per rank placed in a V (`v_stage`: the model runs down
the ranks and back up), the order found by a list scheduler over all ranks at once.

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


def v_stage(pp: int, rank: int, chunk: int) -> int:
    """ZBV's V placement: chunk 0 of rank r is stage r, chunk 1 is stage 2p - 1 - r, so the
    model runs down the ranks and back up, and rank 0 holds both the first and last stage."""
    if chunk not in (0, 1) or not 0 <= rank < pp:
        raise ValueError(f"rank={rank}, chunk={chunk}: the rule: 0 <= rank < pp={pp}, chunk 0 or 1")
    return rank if chunk == 0 else 2 * pp - 1 - rank


def zbv_schedules(
    pp: int,
    num_microbatches: int,
    forward_cost: float = 1.0,
    backward_cost: float = 1.0,
    weight_cost: float = 1.0,
) -> list[list[Op]]:
    """Every rank's F, B and W order for ZBV (two chunks per rank in a V, `v_stage`).

    A list scheduler in logical time, run for all ranks at once (each rank computes the
    same tables, so none communicates): whenever a rank is free it runs, in this order of
    preference, a ready B (the critical path), a ready F if fewer than 2p chunk
    micro-batches await their W (1F1B's activation memory: p whole stages), else its oldest
    pending W; with nothing ready it waits. Each (kind, chunk) runs its micro-batches in
    order, so the p2p streams between two ranks keep their order.

    With F, B and W of one chunk costing the same, each rank's only idle time is the
    start-up (p - 1 units): a bubble of (p - 1) / (6m), half ZB-H1's at the same work, for
    every p <= 4 and m >= p; a greedy rule, not the paper's search, so at p 5..8 it leaves
    a few units more (at most 4 at m >= p in the tests). With m < p the dependency chain
    itself is longer than 6m.
    """
    if pp < 1 or num_microbatches < 1:
        raise ValueError(f"pp={pp}, num_microbatches={num_microbatches}: both must be >= 1")
    p, m = pp, num_microbatches
    cap = 2 * p  # chunk micro-batches between F and W: 1F1B's p whole stages
    last = 2 * p - 1
    cost = {"F": forward_cost, "B": backward_cost, "W": weight_cost}
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, stage) -> end time
    free = [0.0] * p
    nxt = [{("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0} for _ in range(p)]
    pending: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # (mb, chunk) awaiting W
    held = [0] * p  # chunk micro-batches between their F and their W
    ops: list[list[Op]] = [[] for _ in range(p)]

    def arrival(kind: str, mb: int, stage: int) -> float | None:
        """When (kind, mb) may start on `stage`: its input's end, or None if not yet known."""
        if kind == "F":
            return 0.0 if stage == 0 else done.get(("F", mb, stage - 1))
        if stage == last:
            return done.get(("F", mb, stage))
        return done.get(("B", mb, stage + 1))

    def candidates(r: int) -> list[tuple[float, int, str, int, int]]:
        """(ready time, preference, kind, micro-batch, chunk) of r's next F's and B's."""
        out = []
        for (kind, chunk), mb in nxt[r].items():
            if mb >= m or (kind == "F" and held[r] >= cap):
                continue
            if kind == "B" and mb >= nxt[r][("F", chunk)]:
                continue
            at = arrival(kind, mb, v_stage(p, r, chunk))
            if at is not None:
                out.append((at, 0 if kind == "B" else 1, kind, mb, chunk))
        return out

    while any(len(o) < 6 * m for o in ops):
        best = None  # (start, rank, kind, mb, chunk)
        for r in range(p):
            ready = [c for c in candidates(r) if c[0] <= free[r]]
            if ready:
                _, _, kind, mb, chunk = min(ready, key=lambda c: (c[1], c[3], -c[4]))
                choice = (free[r], r, kind, mb, chunk)
            elif pending[r]:
                choice = (free[r], r, "W", *pending[r][0])
            else:
                later = candidates(r)
                if not later:
                    continue
                at, _, kind, mb, chunk = min(later, key=lambda c: (c[0], c[1], c[3], -c[4]))
                choice = (at, r, kind, mb, chunk)
            if best is None or choice[:2] < best[:2]:
                best = choice
        if best is None:
            raise RuntimeError(f"ZBV table stuck at pp={p}, m={m}: a bug in zbv_schedules")
        start, r, kind, mb, chunk = best
        end = start + cost[kind]
        free[r] = end
        ops[r].append(Op(kind, mb, chunk))
        if kind == "W":
            pending[r].pop(0)
            held[r] -= 1
            continue
        done[(kind, mb, v_stage(p, r, chunk))] = end
        nxt[r][(kind, chunk)] += 1
        if kind == "F":
            held[r] += 1
        else:
            pending[r].append((mb, chunk))
    return ops
