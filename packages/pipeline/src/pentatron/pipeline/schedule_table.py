"""The order of forward and backward passes, as pure functions of (p, v, m, rank).

`get_schedule_table` is Megatron-LM's table for the interleaved schedule: virtual step k
runs forward of `table[k] = (microbatch, chunk)`; backward step k runs the same micro-batch
through chunk `v - 1 - chunk`. `warmup_count` and `rank_schedule` give each rank's phases
(warm-up forwards, steady one-forward-one-backward, cool-down backwards), which the
executors in `schedules/` follow and the simulator in `timeline.py` replays.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    """One compute step: `kind` is "F" or "B", of `microbatch` through model `chunk`."""

    kind: str
    microbatch: int
    chunk: int


def get_schedule_table(
    num_microbatches: int, num_model_chunks: int, microbatch_group_size_per_vp_stage: int
) -> list[tuple[int, int]]:
    """(microbatch id, chunk id) per virtual forward step, Megatron-LM's order.

    Micro-batches go through the chunks in groups of `microbatch_group_size_per_vp_stage`:
    group 0 through chunk 0, then chunk 1, ..., then group 1; the last group holds the rest.
    E.g. m=5, v=2, group 3 -> mb 0 1 2 0 1 2 3 4 3 4, chunk 0 0 0 1 1 1 0 0 1 1.
    """
    table: list[tuple[int, int]] = []
    group = microbatch_group_size_per_vp_stage
    for first in range(0, num_microbatches, group):
        members = range(first, min(first + group, num_microbatches))
        table.extend((mb, chunk) for chunk in range(num_model_chunks) for mb in members)
    return table


def warmup_count(
    pp: int,
    rank: int,
    num_microbatches: int,
    vpp: int | None = None,
    group_size: int | None = None,
    forward_only: bool = False,
) -> int:
    """Forward passes before the first backward on pipeline rank `rank`.

    1F1B: min(p - r - 1, m). Interleaved: (p - r - 1) * 2 + (v - 1) * group, capped at m * v.
    Forward-only: every forward.
    """
    total = num_microbatches * (vpp or 1)
    if forward_only:
        return total
    if vpp is None:
        return min(pp - rank - 1, num_microbatches)
    group = group_size or pp
    return min((pp - rank - 1) * 2 + (vpp - 1) * group, total)


def forward_op(table: list[tuple[int, int]], k: int) -> Op:
    mb, chunk = table[k]
    return Op("F", mb, chunk)


def backward_op(table: list[tuple[int, int]], k: int, num_model_chunks: int) -> Op:
    mb, chunk = table[k]
    return Op("B", mb, num_model_chunks - 1 - chunk)


def rank_schedule(
    pp: int,
    rank: int,
    num_microbatches: int,
    vpp: int | None = None,
    group_size: int | None = None,
    forward_only: bool = False,
) -> list[Op]:
    """Every compute step of pipeline rank `rank`, in the order it runs them."""
    v = vpp or 1
    table = get_schedule_table(num_microbatches, v, group_size or pp if vpp else 1)
    total = len(table)
    warm = warmup_count(pp, rank, num_microbatches, vpp, group_size, forward_only)
    ops = [forward_op(table, k) for k in range(warm)]
    if forward_only:
        return ops
    for k in range(total - warm):  # steady: forward of step warm + k, then backward of k
        ops += [forward_op(table, warm + k), backward_op(table, k, v)]
    ops += [backward_op(table, k, v) for k in range(total - warm, total)]
    return ops


def phase_counts(
    pp: int,
    rank: int,
    num_microbatches: int,
    vpp: int | None = None,
    group_size: int | None = None,
    forward_only: bool = False,
) -> dict[str, int]:
    """Number of steps in warm-up, steady state and cool-down on `rank`."""
    total = num_microbatches * (vpp or 1)
    warm = warmup_count(pp, rank, num_microbatches, vpp, group_size, forward_only)
    steady = 0 if forward_only else total - warm
    return {"warmup": warm, "steady": steady, "cooldown": 0 if forward_only else warm}
