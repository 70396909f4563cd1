"""What the training loop does around each iteration for the logging and hygiene flags:
--logging-level, --manual-gc*, --empty-unused-memory-level, --profile*,
--record-memory-history. `IterationHooks` is built by `Trainer.train` and closed when it
returns (or raises); it puts back what it changed in the process (gc, memory history).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator
from typing import Any

import torch

from .profiling import make_memory_history, make_step_profiler


def apply_logging_level(level: int | None) -> None:
    """--logging-level: the root logger's level (Megatron's `setLevel`), left unset if None."""
    if level is not None:
        logging.getLogger().setLevel(level)


class ManualGC:
    """--manual-gc: automatic gc off from `start()` to `close()` (then as it was), with full
    collections at start, every `interval` iterations and before each evaluation, and a
    young-generation one after it (`eval_collect`), at the same points on every rank."""

    def __init__(self, interval: int, eval_collect: bool) -> None:
        self.interval = interval
        self.eval_collect = eval_collect
        self._was_enabled = gc.isenabled()

    def start(self) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()

    def after_step(self, iteration: int) -> None:
        if self.interval and iteration % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        if self.eval_collect:
            gc.collect()  # everything
        yield
        if self.eval_collect:
            gc.collect(generation=0)  # what evaluation made

    def close(self) -> None:
        if self._was_enabled:
            gc.enable()


class EmptyCacheAroundStep:
    """--empty-unused-memory-level on CUDA: the optimizer as `train_step` sees it, releasing
    the caching allocator's unused blocks after forward-backward (level >= 1, before the
    step) and after the optimizer step (level 2), Megatron's two points."""

    def __init__(self, optimizer: Any, level: int) -> None:
        self.optimizer = optimizer
        self.level = level

    def __getattr__(self, name: str) -> Any:  # everything else is the optimizer's
        return getattr(self.optimizer, name)

    def step(self) -> Any:
        torch.cuda.empty_cache()
        result = self.optimizer.step()
        if self.level >= 2:
            torch.cuda.empty_cache()
        return result


class IterationHooks:
    """Built by `Trainer.train` on every rank (`grid`: its `global_rank` and `device`);
    issues no collective."""

    def __init__(self, args: Any, grid: Any) -> None:
        apply_logging_level(args.logging_level)
        rank = grid.global_rank
        self.log_interval = args.log_interval
        # CPU has no caching allocator: --empty-unused-memory-level is a no-op there.
        self.empty_cache_level = args.empty_unused_memory_level if grid.device.type == "cuda" else 0
        self.gc = ManualGC(args.manual_gc_interval, args.manual_gc_eval) if args.manual_gc else None
        self.profiler = make_step_profiler(args, rank, grid.device)
        self.memory_history = make_memory_history(args, rank)
        self._first = True
        if self.memory_history is not None:
            self.memory_history.start()
        if self.gc is not None:
            self.gc.start()

    def optimizer(self, optimizer: Any) -> Any:
        """The optimizer to give `train_step`."""
        if self.empty_cache_level:
            return EmptyCacheAroundStep(optimizer, self.empty_cache_level)
        return optimizer

    def before_step(self, iteration: int) -> None:
        """Before iteration `iteration` (1-based)."""
        if self.profiler is not None:
            self.profiler.step(iteration)

    def after_step(self, iteration: int) -> None:
        if self.memory_history is not None and (
            self._first or iteration % self.log_interval == 0
        ):  # Megatron's points: the first iteration and each log interval
            self.memory_history.dump()
        self._first = False
        if self.gc is not None:
            self.gc.after_step(iteration)

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        with self.gc.evaluation() if self.gc is not None else contextlib.nullcontext():
            yield
        if self.empty_cache_level:
            torch.cuda.empty_cache()

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
        if self.memory_history is not None:
            self.memory_history.close()
        if self.gc is not None:
            self.gc.close()
