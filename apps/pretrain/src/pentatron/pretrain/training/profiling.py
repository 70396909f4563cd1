"""--profile (torch.profiler traces) and --record-memory-history (CUDA allocator snapshots).

Both act on the ranks of --profile-ranks (default: every rank). Iterations are numbered
from 1 as the log line prints them, and the window is the global one: a run resumed at
iteration 11 with --profile-step-start 10 --profile-step-end 14 profiles 11 to 13.

Megatron-LM's --profile drives nsys (cudaProfilerStart/Stop) unless --use-pytorch-profiler
picks torch.profiler. Here --profile always records a torch.profiler trace (what a user
can open without nsys: TensorBoard's profiler plugin, Perfetto, chrome://tracing); on CUDA
the window is also bracketed by cudaProfilerStart/Stop, so a Megatron command line under
`nsys profile --capture-range=cudaProfilerApi` captures the same iterations, unless
--use-pytorch-profiler asks for the torch.profiler trace alone.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

TRACE_FOLDER = "torch_profile"  # under --tensorboard-dir


def profiles_this_rank(args: Any, rank: int) -> bool:
    return not args.profile_ranks or rank in args.profile_ranks


class StepProfiler:
    """torch.profiler over iterations [start, end) with one warm-up iteration before.

    The loop calls `step(n)` before iteration n and `close()` when training ends (which
    also writes a trace cut short by the end of training). The trace is
    `<trace_dir>/rank<r>.<ns>.pt.trace.json.gz`, its steps named `ProfilerStep#<n>`.
    """

    def __init__(
        self,
        *,
        start: int,
        end: int,
        trace_dir: str,
        rank: int,
        device: torch.device,
        nsys_range: bool,
    ) -> None:
        self.start, self.end = max(start, 1), end
        self.device = device
        self.nsys_range = nsys_range and device.type == "cuda"
        self._nsys_open = False
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof: Any = torch.profiler.profile(
            activities=activities,
            schedule=self._action,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                trace_dir, worker_name=f"rank{rank}", use_gzip=True
            ),
        )
        self._started = False

    def _action(self, n: int) -> ProfilerAction:
        """What the profiler does during iteration n (its step_num is the iteration)."""
        if n == self.start - 1 and n >= 1:
            return ProfilerAction.WARMUP
        if self.start <= n < self.end - 1:
            return ProfilerAction.RECORD
        if n == self.end - 1:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.NONE

    def step(self, n: int) -> None:
        """Before iteration n (1-based)."""
        if n >= self.end and not self._started:
            return  # the window is behind this run (resumed later)
        if not self._started:
            # Nothing runs between start() and the first step(); from there on step_num is
            # the iteration about to run (ProfilerStep#<n> in the trace).
            self._prof.step_num = n - 1
            self._prof.start()
            self._started = True
        self._prof.step()
        self._nsys(self.start <= n < self.end)

    def _nsys(self, inside: bool) -> None:
        if not self.nsys_range or inside == self._nsys_open:
            return
        torch.cuda.synchronize(self.device)
        (torch.cuda.profiler.start if inside else torch.cuda.profiler.stop)()
        self._nsys_open = inside

    def close(self) -> None:
        self._nsys(False)
        if self._started:
            self._prof.stop()  # writes the trace if the window was still open
            self._started = False


def make_step_profiler(args: Any, rank: int, device: torch.device) -> StepProfiler | None:
    if not args.profile or not profiles_this_rank(args, rank):
        return None
    return StepProfiler(
        start=args.profile_step_start,
        end=args.profile_step_end,
        trace_dir=os.path.join(args.tensorboard_dir, TRACE_FOLDER),
        rank=rank,
        device=device,
        nsys_range=not args.use_pytorch_profiler,
    )


class MemoryHistory:
    """torch.cuda.memory._record_memory_history from `start()`; `dump()` writes the
    snapshot to <stem>_<rank><suffix> of --memory-snapshot-path (overwritten at each dump,
    as Megatron's at each log interval). CUDA only (validation refuses it on CPU)."""

    MAX_ENTRIES = 100_000  # alloc/free events kept (Megatron's)

    def __init__(self, snapshot_path: str, rank: int) -> None:
        stem, suffix = os.path.splitext(snapshot_path)
        self.path = f"{stem}_{rank}{suffix}"

    def start(self) -> None:
        torch.cuda.memory._record_memory_history(max_entries=self.MAX_ENTRIES)

    def dump(self) -> None:
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        torch.cuda.memory._dump_snapshot(self.path)

    def close(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)


def make_memory_history(args: Any, rank: int) -> MemoryHistory | None:
    if not args.record_memory_history or not profiles_this_rank(args, rank):
        return None
    return MemoryHistory(args.memory_snapshot_path, rank)
