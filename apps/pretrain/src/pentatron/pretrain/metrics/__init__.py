"""Training logs of pentatron.pretrain: console lines, TensorBoard scalars, a JSONL file.

    from pentatron.pretrain.metrics import TrainingLogger

    logger = TrainingLogger(log_interval=10, train_iters=1000, jsonl_path="run/metrics.jsonl",
                            tensorboard_dir="run/tensorboard", enabled=is_last_rank,
                            flops_per_iteration=flops, tokens_per_iteration=gbs * seq_len,
                            global_batch_size=gbs, world_size=world_size)
    logger.log_train(it, {"lm loss": loss, "lr": lr, "grad_norm": gn, "loss_scale": scale,
                          "skipped": 0, "elapsed_s": dt})
    logger.log_eval(it, {"lm loss": val_loss})
    logger.close()

The folder is named `metrics` (not `logging`) so that `pentatron.pretrain.logging` never
stands in for the standard library's `logging` in anyone's namespace.
"""

from __future__ import annotations

from .interval import IntervalStats, IntervalSummary
from .logger import TrainingLogger
from .throughput import format_eta, peak_memory_bytes, tflops_per_device, tokens_per_second

__all__ = [
    "IntervalStats",
    "IntervalSummary",
    "TrainingLogger",
    "format_eta",
    "peak_memory_bytes",
    "tflops_per_device",
    "tokens_per_second",
]
