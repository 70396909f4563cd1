"""Timelines: record what each rank did and when, or simulate a schedule in logical time.

An `Event` is (rank, start, end, kind, microbatch, chunk); kinds are "forward",
"backward", "weight" (compute: a zero-bubble schedule's backward is its input gradient and
"weight" its weight gradient) and "p2p" (time inside a p2p exchange). A `Timeline` handed to a
schedule records its events with a wall clock; `simulate` replays `rank_schedule` with
given forward / backward / p2p costs, assuming sends never block (each op starts when its
rank is free and its input has arrived), which is the schedule's logical cost model.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from .schedule_table import Op, rank_schedule

COMPUTE_KINDS = ("forward", "backward", "weight")
_KIND_OF_OP = {"F": "forward", "B": "backward", "W": "weight"}
_OP_OF_KIND = {kind: op for op, kind in _KIND_OF_OP.items()}


@dataclass(frozen=True)
class Event:
    rank: int
    start: float
    end: float
    kind: str
    microbatch: int | None = None
    chunk: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """Event recorder of one rank; pass it to a schedule as `timeline=`."""

    rank: int = 0
    clock: Callable[[], float] = time.perf_counter
    events: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._t0 = self.clock()

    @contextlib.contextmanager
    def span(
        self, kind: str, microbatch: int | None = None, chunk: int | None = None
    ) -> Iterator[None]:
        start = self.clock() - self._t0
        try:
            yield
        finally:
            self.events.append(
                Event(self.rank, start, self.clock() - self._t0, kind, microbatch, chunk)
            )

    def ops(self) -> list[Op]:
        """The compute steps in the order this rank ran them."""
        ops = []
        for e in self.events:
            if e.kind not in COMPUTE_KINDS:
                continue
            if e.microbatch is None or e.chunk is None:
                raise ValueError(
                    f"{e.kind} event {e} has no microbatch or chunk; an op needs both "
                    "(record compute spans with span(kind, microbatch, chunk))"
                )
            ops.append(Op(_OP_OF_KIND[e.kind], e.microbatch, e.chunk))
        return ops


class ScheduleDeadlock(RuntimeError):
    """The op order cannot run: some rank waits on an op that never runs."""


def simulate_ops(
    ops_per_rank: Sequence[Sequence[Op]],
    num_model_chunks: int = 1,
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    p2p_cost: float = 0.0,
    weight_cost: float = 1.0,
    placement: str = "interleaved",
) -> list[Event]:
    """Logical-time run of per-rank op orders on p ranks with v chunks each.

    Chunk c on rank r is virtual stage s = c * p + r (`placement="interleaved"`), or with
    `placement="v"` (two chunks, ZBV) s = r for chunk 0 and 2p - 1 - r for chunk 1. F(mb, s)
    needs F(mb, s - 1), B(mb, s) needs B(mb, s + 1) or, on the last stage, F(mb, s), each
    plus p2p_cost where the two stages sit on different ranks; W(mb, s) needs B(mb, s)
    (same rank). Each rank runs its ops in order, one at a time. `backward_cost` is a B's:
    a whole backward in 1F1B / interleaved, the input gradient alone where the schedule
    has W's (`weight_cost`).
    """
    p = len(ops_per_rank)
    last = p * num_model_chunks - 1
    if placement == "v":
        if num_model_chunks != 2:
            raise ValueError(f"placement='v' with {num_model_chunks} chunks: the V has 2")

        def stage_of(r: int, c: int) -> int:
            return r if c == 0 else 2 * p - 1 - r

        def rank_of(s: int) -> int:
            return s if s < p else 2 * p - 1 - s
    elif placement == "interleaved":

        def stage_of(r: int, c: int) -> int:
            return c * p + r

        def rank_of(s: int) -> int:
            return s % p
    else:
        raise ValueError(f"placement={placement!r}: 'interleaved' or 'v'")
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    pos = [0] * p
    events: list[Event] = []

    def ready(op: Op, rank: int) -> float | None:
        s = stage_of(rank, op.chunk)
        if op.kind == "W":
            key = ("B", op.microbatch, s)
            return done.get(key)
        if op.kind == "F" and s == 0:
            return 0.0
        if op.kind == "F":
            dep = ("F", op.microbatch, s - 1)
        else:
            dep = ("B", op.microbatch, s + 1) if s < last else ("F", op.microbatch, s)
        if dep not in done:
            return None
        return done[dep] + (p2p_cost if rank_of(dep[2]) != rank else 0.0)

    while any(pos[r] < len(ops_per_rank[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(ops_per_rank[r]):
                op = ops_per_rank[r][pos[r]]
                arrival = ready(op, r)
                if arrival is None:
                    break
                start = max(free[r], arrival)
                cost = {"F": forward_cost, "B": backward_cost, "W": weight_cost}[op.kind]
                end = start + cost
                done[(op.kind, op.microbatch, stage_of(r, op.chunk))] = end
                events.append(Event(r, start, end, _KIND_OF_OP[op.kind], op.microbatch, op.chunk))
                free[r] = end
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: ops_per_rank[r][pos[r]] for r in range(p) if pos[r] < len(ops_per_rank[r])}
            raise ScheduleDeadlock(f"no rank can proceed; next ops per rank: {stuck}")
    return sorted(events, key=lambda e: (e.rank, e.start))


def simulate(
    pp: int,
    num_microbatches: int,
    vpp: int | None = None,
    group_size: int | None = None,
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    p2p_cost: float = 0.0,
    forward_only: bool = False,
    schedule: str | None = None,
    weight_cost: float = 1.0,
) -> list[Event]:
    """Simulate the schedule `get_forward_backward_func(pp, vpp)` runs (see `simulate_ops`),
    or with `schedule="zb-h1"` / `"zbv"` a zero-bubble table (`zero_bubble`; its B is the
    input gradient alone, so pass its cost as `backward_cost`; ZBV's costs are a chunk's,
    half a stage's)."""
    if schedule == "zbv":
        if vpp is not None or forward_only:
            raise ValueError(
                f"schedule='zbv' with vpp={vpp}, forward_only={forward_only}: the rule: ZBV has "
                "its own two chunks per rank and a backward; fix: vpp=None"
            )
        from .zero_bubble import zbv_schedules

        ops = zbv_schedules(pp, num_microbatches, forward_cost, backward_cost, weight_cost)
        return simulate_ops(ops, 2, forward_cost, backward_cost, p2p_cost, weight_cost, "v")
    if schedule == "zb-h1":
        if vpp is not None or forward_only:
            raise ValueError(
                f"schedule='zb-h1' with vpp={vpp}, forward_only={forward_only}: the rule: "
                "ZB-H1 has one chunk per rank and a backward; fix: vpp=None"
            )
        from .zero_bubble import zb_h1_rank_schedule

        ops = [zb_h1_rank_schedule(pp, r, num_microbatches) for r in range(pp)]
    elif schedule not in (None, "1f1b", "interleaved"):
        raise ValueError(f"schedule={schedule!r}: one of '1f1b', 'interleaved', 'zb-h1', 'zbv'")
    else:
        ops = [
            rank_schedule(pp, r, num_microbatches, vpp, group_size, forward_only) for r in range(pp)
        ]
    return simulate_ops(ops, vpp or 1, forward_cost, backward_cost, p2p_cost, weight_cost)


def to_chrome_trace(events: Sequence[Event], time_unit_us: float = 1e6) -> dict:
    """Chrome / Perfetto trace (`chrome://tracing`): one thread per rank, times in µs."""
    trace = []
    for e in events:
        tag = _OP_OF_KIND.get(e.kind, e.kind)
        name = tag if e.microbatch is None else f"{tag}{e.microbatch}"
        if e.chunk is not None and e.kind in COMPUTE_KINDS:
            name += f".c{e.chunk}"
        trace.append(
            {
                "name": name,
                "cat": e.kind,
                "ph": "X",
                "pid": 0,
                "tid": e.rank,
                "ts": e.start * time_unit_us,
                "dur": e.duration * time_unit_us,
                "args": {"microbatch": e.microbatch, "chunk": e.chunk},
            }
        )
    ranks = sorted({e.rank for e in events})
    meta = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
        for r in ranks
    ]
    return {"traceEvents": meta + trace, "displayTimeUnit": "ms"}
