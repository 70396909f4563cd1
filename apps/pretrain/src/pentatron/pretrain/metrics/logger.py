"""`TrainingLogger`: what the training loop calls every iteration and after each evaluation.

Only the rank that logs (Megatron: the last rank, which holds the loss) passes
`enabled=True`; on every other rank each method returns at once and no file is opened.
Every `log_interval` iterations (and at `train_iters`) the interval's figures become one
record, which goes to the console (Megatron's line), to TensorBoard and to the JSONL file.
"""

from __future__ import annotations

import math
import time
from typing import Any

from .console import ConsoleSink, format_eval_lines, format_train_line
from .interval import IntervalStats, moe_record
from .sinks import JsonlSink, TensorBoardSink
from .throughput import format_eta, peak_memory_bytes, tflops_per_device


class TrainingLogger:
    """Aggregates per-iteration metrics over `log_interval` and writes them out.

    `log_train(iteration, metrics)` takes, per iteration (1-based, as Megatron counts):
    `"lm loss"`, `"lr"`, `"grad_norm"` (may be None), `"loss_scale"`, `"num_zeros"` (may be
    None), `"skipped"` (0/1), `"elapsed_s"` (that iteration's wall time) and optionally
    `"memory"` (bytes; if absent the logger asks `peak_memory_bytes()`), `"nan"` (0/1, the
    loop's own finiteness check), `"consumed_samples"` (else `iteration * global_batch_size`),
    `"global_batch_size"` (this iteration's, under batch-size ramp-up), `"tokens"` and
    `"flops"` (this iteration's, overriding the constants below).

    `flops_per_iteration` is the model FLOPs of one step on the global batch
    (`num_floating_point_operations(config, s, V, global_batch_size)`), and
    `tokens_per_iteration` that batch's tokens (`global_batch_size * seq_length`). With
    `seq_length` and a per-iteration `"global_batch_size"`, both are scaled to that batch.
    Without them the line has no TFLOP/s or tokens/s.
    """

    def __init__(
        self,
        *,
        log_interval: int,
        train_iters: int,
        jsonl_path: str | None,
        tensorboard_dir: str | None,
        enabled: bool,
        progress: bool = True,
        flops_per_iteration: float | None = None,
        tokens_per_iteration: int | None = None,
        world_size: int = 1,
        console: Any = None,
        global_batch_size: int | None = None,
        seq_length: int | None = None,
    ) -> None:
        if log_interval < 1:
            raise ValueError(f"log_interval must be >= 1, got {log_interval}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.enabled = enabled
        self.log_interval = log_interval
        self.train_iters = train_iters
        self.flops_per_iteration = flops_per_iteration
        self.tokens_per_iteration = tokens_per_iteration
        self.global_batch_size = global_batch_size
        self.seq_length = seq_length
        self.world_size = world_size
        self._stats = IntervalStats()
        self._consumed_samples: int | None = None
        self._jsonl: JsonlSink | None = None
        self._tensorboard: TensorBoardSink | None = None
        self._console: ConsoleSink | None = None
        if not enabled:
            return
        self._console = ConsoleSink(console, progress=progress, train_iters=train_iters)
        if jsonl_path:
            self._jsonl = JsonlSink(jsonl_path)
        if tensorboard_dir:
            self._tensorboard = TensorBoardSink(tensorboard_dir)

    # ---- per iteration ------------------------------------------------------------------

    def log_train(self, iteration: int, metrics: dict[str, Any]) -> None:
        """Add one iteration; on `iteration % log_interval == 0` (or the last) write a record."""
        if not self.enabled:
            return
        batch = metrics.get("global_batch_size") or self.global_batch_size
        self._stats.add(
            metrics, tokens=self._tokens(metrics, batch), flops=self._flops(metrics, batch)
        )
        if metrics.get("consumed_samples") is not None:
            self._consumed_samples = int(metrics["consumed_samples"])
        elif batch is not None:
            self._consumed_samples = iteration * batch
        assert self._console is not None
        if iteration % self.log_interval and iteration != self.train_iters:
            self._console.step(iteration)
            return
        record = self._train_record(iteration)
        self._stats.reset()
        self._console.step(iteration, self._status(record))
        self._console.print(format_train_line(record, self.train_iters))
        if self._jsonl is not None:
            self._jsonl.write(record)
        if self._tensorboard is not None:
            self._tensorboard.write_train(record)

    def _tokens(self, metrics: dict[str, Any], batch: int | None) -> float | None:
        if metrics.get("tokens") is not None:
            return float(metrics["tokens"])
        if self.seq_length is not None and batch is not None:
            return float(batch * self.seq_length)
        return None if self.tokens_per_iteration is None else float(self.tokens_per_iteration)

    def _flops(self, metrics: dict[str, Any], batch: int | None) -> float | None:
        if metrics.get("flops") is not None:
            return float(metrics["flops"])
        if self.flops_per_iteration is None:
            return None
        if batch is not None and self.global_batch_size:
            return self.flops_per_iteration * batch / self.global_batch_size
        return self.flops_per_iteration

    def _train_record(self, iteration: int) -> dict[str, Any]:
        s = self._stats.summary()
        dt = s.iteration_time_s
        # tokens/s and TFLOP/s/device over the interval's timed iterations; with constant
        # batches these are tokens_per_second(tokens, dt) and tflops_per_device(flops, dt, ws).
        tokens_s = s.tokens_per_s
        tflops = (
            None
            if s.flops_per_s is None
            else tflops_per_device(s.flops_per_s, 1.0, self.world_size)
        )
        memory = s.memory_bytes if s.memory_bytes is not None else peak_memory_bytes()
        return {
            "iteration": iteration,
            "split": "train",
            "time": time.time(),
            "consumed_samples": self._consumed_samples,
            "consumed_tokens": self._consumed_tokens(iteration),
            "global_batch_size": s.global_batch_size or self.global_batch_size,
            "lm_loss": s.lm_loss,
            "lr": s.lr,
            "grad_norm": s.grad_norm,
            "loss_scale": s.loss_scale,
            "num_zeros": s.num_zeros,
            "iterations_in_interval": s.iterations,
            "skipped_iterations": s.skipped_iterations,
            "nan_iterations": s.nan_iterations,
            "iteration_time_s": dt,
            "tokens_per_s": tokens_s,
            "tflops_per_device": tflops,
            "memory_bytes": memory,
            **moe_record(s.moe_losses),
            "eta_s": dt * max(0, self.train_iters - iteration) if dt is not None else None,
        }

    def _consumed_tokens(self, iteration: int) -> int | None:
        if self.seq_length is not None and self._consumed_samples is not None:
            return self._consumed_samples * self.seq_length
        if self.tokens_per_iteration is None:
            return None
        return iteration * self.tokens_per_iteration

    @staticmethod
    def _status(record: dict[str, Any]) -> str:
        parts = []
        if record["lm_loss"] is not None:
            parts.append(f"loss {record['lm_loss']:.4f}")
        if record["tokens_per_s"] is not None:
            parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
        if record["eta_s"] is not None:
            parts.append(f"ETA {format_eta(record['eta_s'])}")
        return " | ".join(parts)

    # ---- evaluation ---------------------------------------------------------------------

    def log_eval(
        self, iteration: int, metrics: dict[str, Any], *, label: str = "validation"
    ) -> None:
        """Validation loss at `iteration` (`"lm loss"`; `"ppl"` defaults to Megatron's
        `exp(min(20, loss))`)."""
        if not self.enabled:
            return
        loss = metrics.get("lm loss", metrics.get("lm_loss"))
        loss = None if loss is None else float(loss)
        ppl = metrics.get("ppl")
        if ppl is None and loss is not None:
            ppl = math.exp(min(20.0, loss)) if math.isfinite(loss) else float("nan")
        record = {
            "iteration": iteration,
            "split": "valid" if label == "validation" else label,
            "time": time.time(),
            "consumed_samples": self._consumed_samples,
            "consumed_tokens": self._consumed_tokens(iteration),
            "lm_loss": loss,
            "ppl": None if ppl is None else float(ppl),
        }
        assert self._console is not None
        for line in format_eval_lines(record, label):
            self._console.print(line)
        if self._jsonl is not None:
            self._jsonl.write(record)
        if self._tensorboard is not None:
            self._tensorboard.write_eval(record, label)

    def close(self) -> None:
        """Stop the progress bar and close the files (safe to call twice)."""
        if not self.enabled:
            return
        if self._console is not None:
            self._console.close()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def __enter__(self) -> TrainingLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
