"""`--async-save`: write a checkpoint in a background thread while training goes on.

The checkpoint is made safe to write later by copying ("staging") every tensor this rank
saves to new CPU memory first, on the training thread; the copy is what the thread writes,
so later optimizer steps cannot leak into it. Publishing is the same as a synchronous save
(rename `iter_N.tmp` -> `iter_N`, then the latest file) and happens only once every rank's
write has finished, so a crash at any point leaves the previous latest checkpoint intact.

Why a dedicated gloo group ("async-checkpoint", on the grid's host backend): DCP's planning
and metadata exchange run collectives from the writer thread, and two threads issuing
collectives on one group would interleave them. The group and the writer thread (one,
named "pentatron-async-save", running `dcp.save`) are created once by `AsyncSaver()`
(collectively) and ended by `close()`, which joins the thread and destroys the group; at
most one save is in flight (a new save, the end of training, or `finalize(blocking=True)`
waits for the previous one).

Whether every rank has finished is agreed with the exit flags the loop already all-reduces
each iteration (`pending()`), so an in-flight save costs no extra collective.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from pentatron.optim.dcp_chunks import ChunkSavePlanner, GlobalChunks
from pentatron.parallel_state import ProcessGrid, comm


def stage(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of `state_dict` whose tensors (also inside GlobalChunks) own new CPU memory."""

    def copy(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True)

    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        if isinstance(value, GlobalChunks):
            out[key] = GlobalChunks(value.size, [(o, copy(t)) for o, t in value.chunks])
        elif isinstance(value, torch.Tensor):
            out[key] = copy(value)
        else:
            out[key] = value
    return out


@dataclass
class _Pending:
    future: Future
    iteration: int
    publish: Any  # publish() -> None: rank 0's rename + latest file


class AsyncSaver:
    """Collective: owns the writer thread, its group and the save in flight (if any)."""

    def __init__(self, grid: ProcessGrid | None = None) -> None:
        backend = grid.device_choice.host_backend if grid is not None else "gloo"
        self.group = dist.new_group(backend=backend)
        comm.register_group_name(self.group, "async-checkpoint")
        # Barriers of the training thread: the grid's host group (the world without a grid).
        self.host_group = grid.host_group if grid is not None else None
        self.in_flight: _Pending | None = None
        # What dcp.async_save does (one thread running dcp.save on the staged copy), with
        # a thread we own and join in close(); DCP's own stager would not look inside
        # GlobalChunks, which stage() copies.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pentatron-async-save")

    def start(self, state_dict: dict[str, Any], tmp: str, iteration: int, publish: Any) -> None:
        """Stage `state_dict` and start writing it into `tmp`; `publish` runs on rank 0
        after every rank finished (see `finalize`)."""
        self.finalize(blocking=True)
        future = self._writer.submit(
            dcp.save,
            stage(state_dict),
            storage_writer=FileSystemWriter(tmp),
            planner=ChunkSavePlanner(),
            process_group=self.group,
        )
        self.in_flight = _Pending(future, iteration, publish)

    def pending(self) -> bool:
        """This rank's write has not finished yet (False when nothing is in flight)."""
        return self.in_flight is not None and not self.in_flight.future.done()

    def finalize(self, blocking: bool, all_done: bool = True) -> int | None:
        """Publish the save in flight; returns its iteration, or None if none was published.

        Collective when a save is in flight. `blocking=False` publishes only if `all_done`
        (the world agreed no rank is `pending()`), else leaves it in flight.
        """
        if self.in_flight is None or not (blocking or all_done):
            return None
        pending, self.in_flight = self.in_flight, None
        pending.future.result()  # re-raises a failed write on this rank
        comm.barrier(self.host_group)  # every rank's files are complete before it is visible
        if dist.get_rank() == 0:
            pending.publish()
        comm.barrier(self.host_group)
        return pending.iteration

    def close(self, finish: bool = True) -> None:
        """Publish the save in flight (collective, as `finalize(blocking=True)`), join the
        writer thread and destroy the writer's group. Idempotent.

        `finish=False` (after an error that other ranks may not share): nothing collective
        and no wait; the save in flight is not published and the thread ends after it.
        The group stays registered by name, for `parallel_state.shutdown`."""
        if self.group is None:
            return
        if not finish:
            self.in_flight = None
            self._writer.shutdown(wait=False, cancel_futures=True)
            return
        self.finalize(blocking=True)
        self._writer.shutdown(wait=True)
        group, self.group = self.group, None
        comm.forget_group(group)
        dist.destroy_process_group(group)
