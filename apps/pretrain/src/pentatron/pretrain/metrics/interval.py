"""What one log interval gathered: sums and counts, summarised every `log_interval` steps.

Counting follows Megatron's `training_log`: the loss is averaged over the iterations that
advanced (not skipped), the learning rate, loss scale, grad norm, zero count and params norm
are the last iteration's, and the iteration time is the mean over every iteration of the interval. One
difference: an iteration whose loss is NaN/Inf (or that the loop flags `"nan": 1`) is counted
as a nan iteration whether or not the optimizer skipped it, and is left out of the mean loss (so one bad step does not turn
the interval's loss into NaN; the nan count shows it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Rate:
    """Sum of an amount over timed iterations, and their time; unknown if any was unknown."""

    amount: float = 0.0
    seconds: float = 0.0
    known: bool = True

    def add(self, amount: float | None, seconds: float) -> None:
        if amount is None:
            self.known = False
        else:
            self.amount += amount
            self.seconds += seconds

    def rate(self) -> float | None:
        return self.amount / self.seconds if self.known and self.seconds > 0 else None


@dataclass
class IntervalSummary:
    """The figures of one interval; `None` where nothing was measured."""

    iterations: int
    lm_loss: float | None
    lr: float | None
    grad_norm: float | None
    loss_scale: float | None
    num_zeros: float | None
    skipped_iterations: int
    nan_iterations: int
    iteration_time_s: float | None
    tokens_per_s: float | None  # tokens of the timed iterations / their time
    flops_per_s: float | None  # model FLOPs of the timed iterations / their time (all devices)
    global_batch_size: int | None
    memory_bytes: int | None
    moe_losses: dict[str, list[float]] | None = None  # MoE aux loss -> per-layer mean
    params_norm: float | None = None  # the last iteration's (--log-params-norm)
    mtp_losses: dict[str, float] | None = None  # "mtp_<k> loss" -> mean over the interval


@dataclass
class IntervalStats:
    """Accumulates `log_train` metrics until `summary()`; `reset()` starts the next interval."""

    iterations: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    skipped: int = 0
    nan: int = 0
    time_sum: float = 0.0
    time_count: int = 0
    tokens: _Rate = field(default_factory=lambda: _Rate())
    flops: _Rate = field(default_factory=lambda: _Rate())
    last: dict[str, float | None] = field(default_factory=dict)
    memory_bytes: int | None = None
    moe_sum: dict[str, list[float]] = field(default_factory=dict)
    moe_count: int = 0
    mtp_sum: dict[str, float] = field(default_factory=dict)
    mtp_count: dict[str, int] = field(default_factory=dict)

    def add(
        self, metrics: dict[str, Any], tokens: float | None = None, flops: float | None = None
    ) -> None:
        """One iteration's metrics; `tokens` / `flops`: what it processed (None: unknown)."""
        self.iterations += 1
        skipped = bool(metrics.get("skipped") or 0)
        self.skipped += int(skipped)
        loss = metrics.get("lm loss", metrics.get("lm_loss"))
        loss = None if loss is None else float(loss)
        nan = bool(metrics.get("nan") or 0) or (loss is not None and not math.isfinite(loss))
        self.nan += int(nan)
        if loss is not None and not nan and not skipped:
            self.loss_sum += loss
            self.loss_count += 1
        elapsed = metrics.get("elapsed_s")
        if elapsed is not None:
            self.time_sum += float(elapsed)
            self.time_count += 1
            self.tokens.add(tokens, float(elapsed))
            self.flops.add(flops, float(elapsed))
        for key in (
            "lr",
            "grad_norm",
            "loss_scale",
            "num_zeros",
            "global_batch_size",
            "params_norm",
        ):
            if key in metrics:
                self.last[key] = None if metrics[key] is None else float(metrics[key])
        memory = metrics.get("memory")
        if memory is not None:
            self.memory_bytes = max(int(memory), self.memory_bytes or 0)
        for name, value in (metrics.get("mtp_losses") or {}).items():
            if value is not None and math.isfinite(value) and not skipped:
                self.mtp_sum[name] = self.mtp_sum.get(name, 0.0) + float(value)
                self.mtp_count[name] = self.mtp_count.get(name, 0) + 1
        if metrics.get("moe_losses"):
            self.moe_count += 1
            for name, layers in metrics["moe_losses"].items():
                acc = self.moe_sum.setdefault(name, [0.0] * len(layers))
                self.moe_sum[name] = [a + float(v) for a, v in zip(acc, layers)]

    def summary(self) -> IntervalSummary:
        return IntervalSummary(
            iterations=self.iterations,
            lm_loss=self.loss_sum / self.loss_count if self.loss_count else None,
            lr=self.last.get("lr"),
            grad_norm=self.last.get("grad_norm"),
            loss_scale=self.last.get("loss_scale"),
            num_zeros=self.last.get("num_zeros"),
            skipped_iterations=self.skipped,
            nan_iterations=self.nan,
            iteration_time_s=self.time_sum / self.time_count if self.time_count else None,
            tokens_per_s=self.tokens.rate(),
            flops_per_s=self.flops.rate(),
            global_batch_size=(
                None
                if self.last.get("global_batch_size") is None
                else int(self.last["global_batch_size"])  # type: ignore[arg-type]
            ),
            memory_bytes=self.memory_bytes,
            moe_losses={
                name: [v / self.moe_count for v in layers] for name, layers in self.moe_sum.items()
            }
            or None,
            params_norm=self.last.get("params_norm"),
            mtp_losses={name: v / self.mtp_count[name] for name, v in self.mtp_sum.items()} or None,
        )

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


def mtp_record(mtp_losses: dict[str, float] | None) -> dict[str, Any]:
    """Record fields of the MTP depths: `mtp_<k>_loss` from Megatron's `mtp_<k> loss`."""
    return {name.replace(" ", "_"): value for name, value in (mtp_losses or {}).items()}


def moe_record(moe_losses: dict[str, list[float]] | None) -> dict[str, Any]:
    """Record fields of the MoE aux losses: `moe_<name>` (mean over the MoE layers, as
    Megatron logs it) and `moe_<name>_per_layer` (0 for dense layers)."""
    out: dict[str, Any] = {}
    for name, layers in (moe_losses or {}).items():
        moe = [v for v in layers if v != 0.0]
        out[f"moe_{name}"] = sum(moe) / len(moe) if moe else 0.0
        out[f"moe_{name}_per_layer"] = list(layers)
    return out
