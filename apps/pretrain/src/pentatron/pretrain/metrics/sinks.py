"""Where records go: a JSONL file, TensorBoard event files, Weights & Biases.

TensorBoard and wandb take the same scalars, `(tag, value, x)` with Megatron's tags; `x` is
the iteration, or the consumed samples for the `... vs samples` tags (which wandb, whose
x-axis is the step, leaves out). Which scalars a record gives is decided here:
`iteration_scalars` (loss, lr, norms: Megatron writes them every --tensorboard-log-interval
iterations), `interval_scalars` (timers, counts, MoE: at each log interval) and
`eval_scalars`.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

Scalar = tuple[str, float, int]  # tag, value, x

# TensorBoard tag -> record key: one iteration's figures (Megatron's tags).
ITERATION_TAGS = {
    "lm loss": "lm_loss",
    "learning-rate": "lr",
    "grad-norm": "grad_norm",
    "loss-scale": "loss_scale",
    "num-zeros": "num_zeros",
    "params-norm": "params_norm",
    "batch-size": "global_batch_size",
}
# Over the interval, with --log-timers-to-tensorboard (Megatron: iteration-time).
TIMER_TAGS = {"iteration-time": "iteration_time_s", "throughput/tokens_per_s": "tokens_per_s"}
# With --log-timers-to-tensorboard and --log-throughput (Megatron: throughput, TFLOP/s/GPU).
THROUGHPUT_TAGS = {
    "throughput": "tflops_per_device",
    "throughput/tflops_per_device": "tflops_per_device",
}
COUNT_TAGS = {"skipped-iterations": "skipped_iterations", "nan-iterations": "nan_iterations"}


def _pick(record: dict[str, Any], tags: dict[str, str], x: int) -> list[Scalar]:
    return [
        (tag, float(record[key]), x) for tag, key in tags.items() if record.get(key) is not None
    ]


def _vs_samples(record: dict[str, Any], pairs: dict[str, str]) -> list[Scalar]:
    samples = record.get("consumed_samples")
    if samples is None:
        return []
    return [
        (f"{tag} vs samples", float(record[key]), int(samples))
        for tag, key in pairs.items()
        if record.get(key) is not None
    ]


def iteration_scalars(record: dict[str, Any]) -> list[Scalar]:
    """Loss, lr, grad / params norm, loss scale, batch size of `record` (one iteration's, or
    an interval's), also against consumed samples for the loss and the params norm."""
    # MTP depths under Megatron's tags, `mtp_<k> loss`
    mtp = {key[: -len("_loss")] + " loss": key for key in record if _is_mtp_key(key)}
    return _pick(record, {**ITERATION_TAGS, **mtp}, record["iteration"]) + _vs_samples(
        record, {"lm loss": "lm_loss", "params-norm": "params_norm"}
    )


def _is_mtp_key(key: str) -> bool:
    return key.startswith("mtp_") and key.endswith("_loss")


def interval_scalars(
    record: dict[str, Any], *, timers: bool, throughput: bool, moe_per_layer: bool = False
) -> list[Scalar]:
    """Skipped / nan counts and MoE aux losses of an interval record; with `timers` the
    iteration time and tokens/s, and with `throughput` too the TFLOP/s per device; with
    `moe_per_layer` (--moe-per-layer-logging) each layer's aux losses as Megatron tags
    them, `moe/<name>_layer_<i>` from layer 0 (dense layers 0)."""
    iteration = record["iteration"]
    out = _pick(record, COUNT_TAGS, iteration)
    if timers:
        out += _pick(record, TIMER_TAGS, iteration)
        if throughput:
            out += _pick(record, THROUGHPUT_TAGS, iteration)
    for key, value in record.items():  # MoE aux losses: mean and per layer
        if key.startswith("moe_") and key.endswith("_per_layer"):
            name = key[len("moe_") : -len("_per_layer")]
            if record.get(f"moe_{name}") is not None:
                out.append((name, float(record[f"moe_{name}"]), iteration))
            if moe_per_layer:
                out += [
                    (f"moe/{name}_layer_{layer}", float(v), iteration)
                    for layer, v in enumerate(value)
                    if v is not None
                ]
    return out


def eval_scalars(record: dict[str, Any], label: str, *, ppl: bool) -> list[Scalar]:
    """`lm loss <label>` (and its perplexity with `ppl`), by iteration and by samples."""
    pairs = {f"lm loss {label}": "lm_loss"}
    if ppl:
        pairs[f"lm loss {label} ppl"] = "ppl"
    return _pick(record, pairs, record["iteration"]) + _vs_samples(record, pairs)


def _json_safe(value: Any) -> Any:
    """NaN / Inf become `null`: strict JSON readers (jq, JavaScript) reject `NaN`."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


class JsonlSink:
    """One JSON object per line, appended (a resumed run continues the file), flushed per line."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        parent = os.path.dirname(os.fspath(path))
        if parent:
            os.makedirs(parent, exist_ok=True)
        self.path = os.fspath(path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open for the run)

    def write(self, record: dict[str, Any]) -> None:
        safe = {key: _json_safe(value) for key, value in record.items()}
        self._file.write(json.dumps(safe, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """`torch.utils.tensorboard.SummaryWriter` scalars; events go to disk when `max_queue`
    are pending, every 2 minutes, and at each `flush()` (the logger's log intervals)."""

    def __init__(self, log_dir: str | os.PathLike[str], max_queue: int = 10) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:  # torch raises this when `tensorboard` is missing
            raise ImportError(
                "--tensorboard-dir needs the tensorboard package: pip install tensorboard"
            ) from error
        self.writer = SummaryWriter(log_dir=os.fspath(log_dir), max_queue=max_queue)

    def write(self, iteration: int, scalars: list[Scalar]) -> None:
        for tag, value, x in scalars:
            self.writer.add_scalar(tag, value, x)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run (`wandb.init(**init)`); scalars logged at step = iteration.
    With WANDB_MODE=offline the run is written under `init["dir"]` only (`wandb sync`
    uploads it later)."""

    def __init__(self, init: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as error:
            raise ImportError(
                "--wandb-project needs the wandb package: pip install 'pentatron-pretrain[wandb]'"
            ) from error
        kwargs = {key: value for key, value in init.items() if value is not None}
        if kwargs.get("dir"):
            os.makedirs(kwargs["dir"], exist_ok=True)
        self.run = wandb.init(**kwargs)

    def write(self, iteration: int, scalars: list[Scalar]) -> None:
        values = {tag: value for tag, value, _ in scalars if not tag.endswith(" vs samples")}
        if values:
            self.run.log(values, step=iteration)

    def flush(self) -> None:
        pass  # wandb streams in the background

    def close(self) -> None:
        self.run.finish()
