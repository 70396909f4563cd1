"""Bubble accounting: how much of a step the ranks spend idle.

Two views of the same idle time, both from a timeline's compute events:
- `bubble_fraction` = idle / busy, Megatron-LM's t_bubble / t_ideal: (p-1)/m for 1F1B and
  (p-1)/(v*m) for interleaving when a backward costs twice a forward and p2p is free;
- `bubble_share` = idle / (p * makespan), the idle share of the step: (p-1)/(m+p-1) for
  1F1B in schedule steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .timeline import COMPUTE_KINDS, Event


@dataclass(frozen=True)
class BubbleReport:
    makespan: float  # first compute start to last compute end, over all ranks
    busy: dict[int, float]  # compute time per rank
    idle: dict[int, float]  # makespan - busy, per rank

    @property
    def bubble_fraction(self) -> float:
        """Total idle / total busy (t_bubble / t_ideal)."""
        return sum(self.idle.values()) / sum(self.busy.values())

    @property
    def bubble_share(self) -> float:
        """Total idle / (ranks * makespan)."""
        return sum(self.idle.values()) / (len(self.busy) * self.makespan)

    def summary(self) -> str:
        return (
            f"makespan {self.makespan:g}, bubble fraction (idle/busy) "
            f"{self.bubble_fraction:.4f}, idle share of the step {self.bubble_share:.4f}"
        )


def bubble_report(events: Sequence[Event]) -> BubbleReport:
    compute = [e for e in events if e.kind in COMPUTE_KINDS]
    if not compute:
        raise ValueError("no forward/backward events: nothing to account")
    start = min(e.start for e in compute)
    makespan = max(e.end for e in compute) - start
    busy: dict[int, float] = {}
    for e in compute:
        busy[e.rank] = busy.get(e.rank, 0.0) + e.duration
    idle = {r: makespan - b for r, b in busy.items()}
    return BubbleReport(makespan, busy, idle)


def ideal_bubble_fraction(pp: int, num_microbatches: int, vpp: int | None = None) -> float:
    """Megatron-LM's closed form (p - 1) / (v * m)."""
    return (pp - 1) / ((vpp or 1) * num_microbatches)
