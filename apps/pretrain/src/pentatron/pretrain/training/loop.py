"""Megatron's `train`: iterate train_step, log, evaluate, save, and exit cleanly.

Exit conditions (each agreed by every rank, so all stop at the same iteration): train_iters
reached, --exit-interval, --exit-duration-in-mins, and SIGTERM / SIGINT (torchrun forwards
them to every worker; caught with --exit-signal-handler); the last three save a
checkpoint first when --save is set. A NaN or Inf loss stops the run before the optimizer
step (the last checkpoint stays intact) or, with --on-nan-loss skip, skips that step on
every rank. With --async-save a background write is published at the first iteration end
where every rank has finished it, and at the latest before `train` returns (or raises
NonFiniteLossError: the save before the bad step is good). Nothing started by the loop is
still running when `train` returns. Around each iteration `IterationHooks` applies the
logging, profiling and gc flags (training/hooks.py).
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from pentatron.parallel_state import ProcessGrid

from . import configs
from .hooks import IterationHooks
from .microbatches import global_batch_size, num_microbatches
from .params_norm import params_norm
from .step import agree_flags, evaluate, train_step


def _logged_lr(param_groups) -> float:
    """Megatron's "learning rate": the lr of a group without --decoupled-lr."""
    for group in param_groups:
        if not group.get("is_decoupled_lr"):
            return group["lr"]
    return param_groups[0]["lr"]


class NonFiniteLossError(RuntimeError):
    """The loss was NaN or Inf at some iteration (and --on-nan-loss is "stop")."""


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    losses: list[float | None] = field(default_factory=list)  # per iteration (last stage)
    # per iteration, before clipping, every rank (None where the step did not clip/norm)
    grad_norms: list[float | None] = field(default_factory=list)
    # per iteration with --mtp-num-layers: "mtp_<k> loss" -> value (last stage), else None
    mtp_losses: list[dict[str, float | None] | None] = field(default_factory=list)
    # per iteration with --fp16: the loss scale after the step (as logged), else None
    loss_scales: list[float | None] = field(default_factory=list)
    exit_reason: str = ""


class SignalCatcher:
    """Remembers SIGTERM / SIGINT instead of dying mid-step; restores the handlers on exit."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)) -> None:
        self.received: int | None = None
        self._old = {s: signal.signal(s, self._handle) for s in signals}

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def signal_catcher(args) -> SignalCatcher:
    """SIGTERM / SIGINT caught with --exit-signal-handler, else none: the signals keep their
    default action (the process dies mid-step, as Megatron's without the flag)."""
    return SignalCatcher() if args.exit_signal_handler else SignalCatcher(signals=())


@dataclass
class Trainer:
    """Everything a training iteration touches; built by `pretrain`."""

    args: Any
    grid: ProcessGrid
    chunks: list
    optimizer: Any
    scheduler: Any
    forward_step: Any
    pcfg: Any
    train_iters: list
    valid_iters: list | None
    logger: Any
    save: Any  # save(state) -> None, or None without --save
    async_saver: Any = None  # checkpointing.AsyncSaver with --async-save
    cuda_graphs: Any = None  # models.LayerCudaGraphs with --enable-cuda-graph
    test_iters: list | None = None  # the test split, evaluated once after training
    hooks: Any = field(default=None, init=False)  # IterationHooks while `train` runs

    def _should_exit(self, state: TrainState, started: float, catcher: SignalCatcher) -> str:
        args = self.args
        over_time = (
            args.exit_duration_in_mins is not None
            and (time.time() - started) / 60.0 > args.exit_duration_in_mins
        )
        writing = self.async_saver is not None and self.async_saver.pending()
        signalled, over_time, writing = agree_flags(
            [catcher.received is not None, over_time, writing], self.grid
        )
        if self.async_saver is not None:  # publish a finished background save
            self.async_saver.finalize(blocking=False, all_done=not writing)
        if signalled:
            return "signal"
        if over_time:
            return "exit-duration-in-mins"
        if args.exit_interval and state.iteration % args.exit_interval == 0:
            return "exit-interval"
        return ""

    def _one_iteration(self, state: TrainState) -> None:
        args = self.args
        m = num_microbatches(args, state.consumed_samples)
        t0 = time.perf_counter()
        if self.cuda_graphs is not None:  # captures once, after the warm-up steps
            self.cuda_graphs.begin_step()
        out = train_step(
            args,
            self.chunks,
            self.train_iters,
            self.forward_step,
            self.hooks.optimizer(self.optimizer) if self.hooks else self.optimizer,
            self.pcfg,
            self.grid,
            m,
        )
        elapsed = time.perf_counter() - t0
        state.iteration += 1
        global_batch = global_batch_size(args, state.consumed_samples)
        state.consumed_samples += global_batch
        if not out.finite and args.on_nan_loss == "stop":
            raise NonFiniteLossError(
                f"iteration {state.iteration}: the loss (or a grad) is NaN/Inf on some rank; stopped "
                "before the optimizer step, no checkpoint written (the last one is intact); "
                "fix: lower --lr or resume from the last checkpoint, or pass --on-nan-loss skip"
            )
        if out.update_successful:
            self.scheduler.step(configs.scheduler_increment(args, global_batch))
        state.losses.append(out.loss)
        state.grad_norms.append(out.grad_norm)
        state.mtp_losses.append(out.mtp_losses)
        # Logged as Megatron logs it: the optimizer's scale after this step's update
        scale = self.optimizer.get_loss_scale()
        state.loss_scales.append(scale if args.fp16 else None)
        self.logger.log_train(
            state.iteration,
            {
                "lm loss": out.loss if out.loss is not None else float("nan"),
                "lr": _logged_lr(self.optimizer.param_groups),
                "grad_norm": out.grad_norm,
                "loss_scale": scale,
                "num_zeros": out.num_zeros,
                "skipped": 0 if out.update_successful else 1,
                "nan": 0 if out.finite else 1,
                "elapsed_s": elapsed,
                "consumed_samples": state.consumed_samples,
                "global_batch_size": global_batch_size(args, state.consumed_samples),
                "moe_losses": out.moe_losses,
                "mtp_losses": out.mtp_losses,
                "params_norm": (
                    params_norm(self.optimizer, bool(getattr(args, "num_experts", None)))
                    if args.log_params_norm
                    else None
                ),
            },
        )

    def _maybe_evaluate(self, state: TrainState) -> None:
        """The validation set every --eval-interval iterations."""
        interval = self.args.eval_interval
        if interval and state.iteration % interval == 0:
            self._evaluate(state, self.valid_iters, "validation")

    def _final_evaluation(self, state: TrainState) -> None:
        """After training ran to --train-iters, as Megatron's `pretrain` does: the validation
        set once more (its next batches) and the test set once. An early exit (signal,
        --exit-interval, --exit-duration-in-mins) skips both, as Megatron's does."""
        self._evaluate(state, self.valid_iters, "validation")
        self._evaluate(state, self.test_iters, "test")

    def _evaluate(self, state: TrainState, iterators: list | None, label: str) -> None:
        args = self.args
        if not iterators or not args.eval_iters:
            return
        # an evaluation batch is a full global batch, also during --rampup-batch-size
        dp_batch = args.micro_batch_size * args.data_parallel_size
        with self.hooks.evaluation() if self.hooks else contextlib.nullcontext():
            loss = evaluate(
                args,
                self.chunks,
                iterators,
                self.forward_step,
                self.pcfg,
                self.grid,
                args.eval_iters,
                args.global_batch_size // dp_batch,
            )
        if loss is not None:
            self.logger.log_eval(state.iteration, {"lm loss": loss}, label=label)

    def train(self, state: TrainState) -> TrainState:
        args, started = self.args, time.time()
        catcher = signal_catcher(args)
        self.hooks = IterationHooks(args, self.grid)
        saved_at = state.iteration
        try:
            while state.iteration < args.train_iters:
                self.hooks.before_step(state.iteration + 1)
                self._one_iteration(state)
                self.hooks.after_step(state.iteration)
                self._maybe_evaluate(state)
                if self.save and args.save_interval and state.iteration % args.save_interval == 0:
                    self.save(state)
                    saved_at = state.iteration
                state.exit_reason = self._should_exit(state, started, catcher)
                if state.exit_reason:
                    break
            else:
                state.exit_reason = "train-iters"
            if self.save and saved_at != state.iteration:
                self.save(state)
            if state.exit_reason == "train-iters":
                self._final_evaluation(state)
        except NonFiniteLossError:
            self._finish_async_work()  # every rank stopped here: the collectives are in step
            raise
        finally:
            catcher.restore()
            self.hooks.close()
            self.hooks = None
        self._finish_async_work()
        return state

    def _finish_async_work(self) -> None:
        """Wait for what is still running when the loop ends: the params' all-gathers the
        last optimizer step started (--overlap-param-gather) and the background save (its
        checkpoint is published). Collective."""
        for chunk in self.chunks:
            chunk.finish_param_sync()
        if self.async_saver is not None:
            self.async_saver.finalize(blocking=True)
