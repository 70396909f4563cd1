"""`TrainingLogger`: what the training loop calls every iteration and after each evaluation.

Only the rank that logs (Megatron: the last rank, which holds the loss) passes
`enabled=True`; on every other rank each method returns at once and no file is opened.
Every `log_interval` iterations (and at `train_iters`) the interval's figures become one
record, which goes to the console (Megatron's line), to the JSONL file, to TensorBoard and
to wandb. With `tensorboard_log_interval` set (the app: Megatron's
--tensorboard-log-interval), TensorBoard and wandb get the loss, lr and norms of every
`tensorboard_log_interval`-th iteration as Megatron writes them, and the interval figures
(timers, counts) at the log intervals; without it (None) everything with the record.
"""

from __future__ import annotations

import math
import time
from typing import Any

from .console import ConsoleSink, format_eval_lines, format_train_line
from .interval import IntervalStats, moe_record, mtp_record
from .sinks import (
    JsonlSink,
    Scalar,
    TensorBoardSink,
    WandbSink,
    eval_scalars,
    interval_scalars,
    iteration_scalars,
)
from .throughput import format_eta, memory_scalars, peak_memory_bytes, tflops_per_device


class TrainingLogger:
    """Aggregates per-iteration metrics over `log_interval` and writes them out.

    `log_train(iteration, metrics)` takes, per iteration (1-based, as Megatron counts):
    `"lm loss"`, `"lr"`, `"grad_norm"` (may be None), `"loss_scale"`, `"num_zeros"` (may be
    None), `"skipped"` (0/1), `"elapsed_s"` (that iteration's wall time) and optionally
    `"memory"` (bytes; if absent the logger asks `peak_memory_bytes()`), `"nan"` (0/1, the
    loop's own finiteness check), `"consumed_samples"` (else `iteration * global_batch_size`),
    `"global_batch_size"` (this iteration's, under batch-size ramp-up), `"tokens"` and
    `"flops"` (this iteration's, overriding the constants below), `"params_norm"`.

    `flops_per_iteration` is the model FLOPs of one step on the global batch
    (`num_floating_point_operations(config, s, V, global_batch_size)`), and
    `tokens_per_iteration` that batch's tokens (`global_batch_size * seq_length`). With
    `seq_length` and a per-iteration `"global_batch_size"`, both are scaled to that batch.
    Without them the line has no TFLOP/s or tokens/s.

    What is written besides the loss (the defaults write everything; `default_logger` sets
    them from Megatron's flags, which default to off): `log_throughput` TFLOP/s on the line,
    `log_timers_to_tensorboard` the iteration time and throughput scalars,
    `log_memory_to_tensorboard` `memory_scalars()`, `log_validation_ppl_to_tensorboard` the
    validation perplexity. The JSONL record always holds every figure. `wandb_init`: the
    keywords of `wandb.init` (project, name, dir, entity, config), or None for no wandb.
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
        log_throughput: bool = True,
        log_timers_to_tensorboard: bool = True,
        log_memory_to_tensorboard: bool = True,
        log_validation_ppl_to_tensorboard: bool = True,
        moe_per_layer_logging: bool = False,
        tensorboard_log_interval: int | None = None,
        tensorboard_queue_size: int = 10,
        wandb_init: dict[str, Any] | None = None,
    ) -> None:
        if log_interval < 1:
            raise ValueError(f"log_interval must be >= 1, got {log_interval}")
        if tensorboard_log_interval is not None and tensorboard_log_interval < 1:
            raise ValueError(
                f"tensorboard_log_interval must be >= 1, got {tensorboard_log_interval}"
            )
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
        self.log_throughput = log_throughput
        self.log_timers_to_tensorboard = log_timers_to_tensorboard
        self.log_memory_to_tensorboard = log_memory_to_tensorboard
        self.log_validation_ppl_to_tensorboard = log_validation_ppl_to_tensorboard
        self.moe_per_layer_logging = moe_per_layer_logging
        self.tensorboard_log_interval = tensorboard_log_interval
        self._stats = IntervalStats()
        self._consumed_samples: int | None = None
        self._jsonl: JsonlSink | None = None
        self._scalar_sinks: list[TensorBoardSink | WandbSink] = []
        self._console: ConsoleSink | None = None
        if not enabled:
            return
        self._console = ConsoleSink(console, progress=progress, train_iters=train_iters)
        if jsonl_path:
            self._jsonl = JsonlSink(jsonl_path)
        if tensorboard_dir:
            self._scalar_sinks.append(TensorBoardSink(tensorboard_dir, tensorboard_queue_size))
        if wandb_init is not None:
            self._scalar_sinks.append(WandbSink(wandb_init))

    def _write_scalars(self, iteration: int, scalars: list[Scalar], flush: bool) -> None:
        for sink in self._scalar_sinks:
            sink.write(iteration, scalars)
            if flush:
                sink.flush()

    def _memory_scalars(self, iteration: int) -> list[Scalar]:
        if not self.log_memory_to_tensorboard:
            return []
        return [(tag, value, iteration) for tag, value in memory_scalars().items()]

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
        every = self.tensorboard_log_interval
        if self._scalar_sinks and every is not None and iteration % every == 0:
            scalars = iteration_scalars(self._iteration_record(iteration, metrics, batch))
            self._write_scalars(iteration, scalars + self._memory_scalars(iteration), False)
        if iteration % self.log_interval and iteration != self.train_iters:
            self._console.step(iteration)
            return
        record = self._train_record(iteration)
        self._stats.reset()
        self._console.step(iteration, self._status(record))
        self._console.print(
            format_train_line(record, self.train_iters, log_throughput=self.log_throughput)
        )
        if self._jsonl is not None:
            self._jsonl.write(record)
        if self._scalar_sinks:
            scalars = interval_scalars(
                record,
                timers=self.log_timers_to_tensorboard,
                throughput=self.log_throughput,
                moe_per_layer=self.moe_per_layer_logging,
            )
            if every is None:
                scalars = iteration_scalars(record) + self._memory_scalars(iteration) + scalars
            self._write_scalars(iteration, scalars, True)

    def _iteration_record(
        self, iteration: int, metrics: dict[str, Any], batch: int | None
    ) -> dict[str, Any]:
        """One iteration's figures under the record's keys (what Megatron writes to
        TensorBoard every --tensorboard-log-interval iterations)."""
        loss = metrics.get("lm loss", metrics.get("lm_loss"))
        return {
            "iteration": iteration,
            "consumed_samples": self._consumed_samples,
            "global_batch_size": batch,
            "lm_loss": None if loss is None else float(loss),
            **{
                key: metrics.get(key)
                for key in ("lr", "grad_norm", "loss_scale", "num_zeros", "params_norm")
            },
            **mtp_record(metrics.get("mtp_losses")),
        }

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
            "params_norm": s.params_norm,
            **moe_record(s.moe_losses),
            **mtp_record(s.mtp_losses),
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
        if self._scalar_sinks:
            ppl_scalars = self.log_validation_ppl_to_tensorboard
            self._write_scalars(iteration, eval_scalars(record, label, ppl=ppl_scalars), True)

    def close(self) -> None:
        """Stop the progress bar and close the files (safe to call twice)."""
        if not self.enabled:
            return
        if self._console is not None:
            self._console.close()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        for sink in self._scalar_sinks:
            sink.close()
        self._scalar_sinks = []

    def __enter__(self) -> TrainingLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
