"""The two files a run writes: a JSONL of records and TensorBoard event files."""

from __future__ import annotations

import json
import math
import os
from typing import Any

# TensorBoard tag -> JSONL record key, for the per-interval training scalars (Megatron's tags).
TRAIN_TAGS = {
    "lm loss": "lm_loss",
    "learning-rate": "lr",
    "grad-norm": "grad_norm",
    "loss-scale": "loss_scale",
    "num-zeros": "num_zeros",
    "batch-size": "global_batch_size",
    "iteration-time": "iteration_time_s",
    "throughput/tokens_per_s": "tokens_per_s",
    "throughput/tflops_per_device": "tflops_per_device",
    "mem-max-allocated-bytes": "memory_bytes",
    "skipped-iterations": "skipped_iterations",
    "nan-iterations": "nan_iterations",
}


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
    """`torch.utils.tensorboard.SummaryWriter` scalars, flushed at every log interval."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:  # torch raises this when `tensorboard` is missing
            raise ImportError(
                "--tensorboard-dir needs the tensorboard package: pip install tensorboard"
            ) from error
        self.writer = SummaryWriter(log_dir=os.fspath(log_dir))

    def _add(self, tag: str, value: Any, step: int) -> None:
        if value is not None:
            self.writer.add_scalar(tag, float(value), step)

    def write_train(self, record: dict[str, Any]) -> None:
        iteration = record["iteration"]
        for tag, key in TRAIN_TAGS.items():
            self._add(tag, record.get(key), iteration)
        for key, value in record.items():  # MoE aux losses: mean and per layer
            if key.startswith("moe_") and key.endswith("_per_layer"):
                name = key[len("moe_") : -len("_per_layer")]
                self._add(name, record.get(f"moe_{name}"), iteration)
                for layer, v in enumerate(value, start=1):
                    self._add(f"moe/{name}_layer_{layer}", v, iteration)
        if record.get("consumed_samples") is not None:
            self._add("lm loss vs samples", record.get("lm_loss"), record["consumed_samples"])
        self.writer.flush()

    def write_eval(self, record: dict[str, Any], label: str = "validation") -> None:
        iteration = record["iteration"]
        self._add(f"lm loss {label}", record.get("lm_loss"), iteration)
        self._add(f"lm loss {label} ppl", record.get("ppl"), iteration)
        if record.get("consumed_samples") is not None:
            samples = record["consumed_samples"]
            self._add(f"lm loss {label} vs samples", record.get("lm_loss"), samples)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
