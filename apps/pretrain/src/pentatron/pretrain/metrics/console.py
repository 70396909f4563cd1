"""Console output: Megatron's one-line-per-interval format, printed through `rich`.

On a terminal (and with `progress=True`) a rich progress bar stays at the bottom showing the
iteration, the interval's loss, tokens/s and the ETA, and each interval's line is printed
above it. When stdout is not a terminal (a log file, a pipe, a batch scheduler) the lines
are printed as plain text: no colours, no cursor moves, no wrapping.
"""

from __future__ import annotations

from typing import Any

from .throughput import format_eta


def _fmt(value: Any, spec: str) -> str:
    return "nan" if value is None else format(value, spec)


def format_train_line(
    record: dict[str, Any], train_iters: int, *, log_throughput: bool = True
) -> str:
    """One interval as Megatron's `training_log` prints it (fields missing from `record` left
    out; TFLOP/s/device only with `log_throughput`, Megatron's --log-throughput).

    ` iteration   10/ 100 | consumed samples:  640 | elapsed time per iteration (ms): 812.3 |
    tokens/s: 80673 | TFLOP/s/device: 41.2 | learning rate: 3.000000E-04 | global batch
    size:    64 | lm loss: 6.412345E+00 | loss scale: 1.0 | grad norm: 1.234 | ... |
    params norm: 262.641 |
    number of skipped iterations:   0 | number of nan iterations:   0 | ETA 0:20:31 |`
    """
    width = len(str(train_iters))
    parts = [f" iteration {record['iteration']:{width}d}/{train_iters:{width}d}"]
    if record.get("consumed_samples") is not None:
        parts.append(f"consumed samples: {record['consumed_samples']:12d}")
    if record.get("iteration_time_s") is not None:
        parts.append(f"elapsed time per iteration (ms): {record['iteration_time_s'] * 1e3:.1f}")
    if record.get("tokens_per_s") is not None:
        parts.append(f"tokens/s: {record['tokens_per_s']:.0f}")
    if log_throughput and record.get("tflops_per_device") is not None:
        tflops = record["tflops_per_device"]
        # CPU runs reach a few GFLOP/s: below 1 keep three significant digits.
        parts.append(
            f"TFLOP/s/device: {tflops:.1f}" if tflops >= 1 else f"TFLOP/s/device: {tflops:.3g}"
        )
    if "lr" in record:
        parts.append(f"learning rate: {_fmt(record['lr'], '.6E')}")
    if record.get("global_batch_size") is not None:
        parts.append(f"global batch size: {record['global_batch_size']:5d}")
    parts.append(f"lm loss: {_fmt(record.get('lm_loss'), '.6E')}")
    for key, value in record.items():  # MTP depths (Megatron's `mtp_<k> loss`)
        if key.startswith("mtp_") and key.endswith("_loss"):
            parts.append(f"{key[: -len('_loss')]} loss: {_fmt(value, '.6E')}")
    for key, value in record.items():  # MoE aux losses (mean over the MoE layers)
        if key.startswith("moe_") and not key.endswith("_per_layer"):
            parts.append(f"{key[len('moe_') :]}: {_fmt(value, '.6E')}")
    if record.get("loss_scale") is not None:
        parts.append(f"loss scale: {record['loss_scale']:.1f}")
    if record.get("grad_norm") is not None:
        parts.append(f"grad norm: {record['grad_norm']:.3f}")
    if record.get("num_zeros") is not None:
        parts.append(f"num zeros: {record['num_zeros']:.1f}")
    if record.get("params_norm") is not None:
        parts.append(f"params norm: {record['params_norm']:.3f}")
    if record.get("memory_bytes") is not None:
        parts.append(f"max memory (MB): {record['memory_bytes'] / 2**20:.1f}")
    parts.append(f"number of skipped iterations: {record['skipped_iterations']:3d}")
    parts.append(f"number of nan iterations: {record['nan_iterations']:3d}")
    if record.get("eta_s") is not None:
        parts.append(f"ETA {format_eta(record['eta_s'])}")
    return " | ".join(parts) + " |"


def format_eval_lines(record: dict[str, Any], label: str = "validation") -> list[str]:
    """Megatron's three validation lines: a rule, `loss value | PPL`, a rule."""
    line = (
        f" {label} loss at iteration {record['iteration']} | "
        f"lm loss value: {_fmt(record.get('lm_loss'), '.6E')} | "
        f"lm loss PPL: {_fmt(record.get('ppl'), '.6E')} | "
    )
    rule = "-" * (len(line) + 1)
    return [rule, line, rule]


class ConsoleSink:
    """Prints lines through a rich Console, with a live progress bar on a terminal."""

    def __init__(self, console: Any = None, *, progress: bool, train_iters: int) -> None:
        from rich.console import Console

        if console is None:
            console = Console()
        elif not isinstance(console, Console):  # a text stream such as sys.stderr
            console = Console(file=console)
        self.console: Console = console
        self.train_iters = train_iters
        self.live = progress and console.is_terminal
        self._progress: Any = None
        self._task: Any = None

    def _start(self, iteration: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            console=self.console,
            refresh_per_second=4,
        )
        self._task = self._progress.add_task(
            "train", total=self.train_iters, completed=iteration, status=""
        )
        self._progress.start()

    def step(self, iteration: int, status: str | None = None) -> None:
        """Advance the bar to `iteration` (no-op without a live bar)."""
        if not self.live:
            return
        if self._progress is None:
            self._start(iteration)
        fields = {} if status is None else {"status": status}
        self._progress.update(self._task, completed=iteration, **fields)

    def print(self, line: str) -> None:
        """One line as is: no markup, no highlighting (it splits `3.0E-04`), no wrapping."""
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
