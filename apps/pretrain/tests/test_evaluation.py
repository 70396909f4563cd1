"""Evaluation as Megatron's `pretrain` runs it: the validation set every --eval-interval
iterations; after training reaches --train-iters, the validation set once more (its next
batches) and the test set once; an early exit skips both. A resumed run's validation
loader continues where the evaluations of the iterations already run left it, so its
evaluation losses equal an uninterrupted run's bitwise."""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _app import TINY_GPT

EVAL = ["--eval-interval", "2", "--eval-iters", "1", "--train-iters", "4", "--seed", "7"]
ARGV = [*TINY_GPT, *EVAL]  # later flags win: --eval-iters 1


class _Evals:
    def __init__(self, *_: object) -> None:
        self.events: list[tuple[int, str, float]] = []

    def log_train(self, iteration: int, metrics: dict) -> None:
        pass

    def log_eval(self, iteration: int, metrics: dict, label: str = "validation") -> None:
        self.events.append((iteration, label, metrics["lm loss"]))

    def close(self) -> None:
        pass


def _run(argv: list[str]) -> list[tuple[int, str, float]]:
    import torch.distributed as dist

    from pentatron.parallel_state import destroy_model_parallel
    from pentatron.pretrain.arguments import parse_args, validate_args
    from pentatron.pretrain.pretrain_gpt import pretrain

    logger = _Evals()
    args = validate_args(parse_args(argv), dist.get_world_size())
    try:
        pretrain(args, logger_factory=lambda *a: logger)
    finally:
        destroy_model_parallel()
    return logger.events


def _full_and_resumed(root: str) -> tuple[list, list, list]:
    ckpt = os.path.join(root, "ckpt")
    full = _run(ARGV)
    first = _run([*ARGV, "--exit-interval", "2", "--save", ckpt, "--save-interval", "2"])
    second = _run([*ARGV, "--load", ckpt])
    return full, first, second


def test_periodic_final_and_test_evaluations_and_resume(distributed, tmp_path):
    results = distributed.run(2, _full_and_resumed, str(tmp_path))  # dp 2
    assert results[0] == results[1]  # the reduced losses, on every rank
    full, first, second = results[0]
    assert [(i, label) for i, label, _ in full] == [
        (2, "validation"),
        (4, "validation"),
        (4, "validation"),  # after training: the validation set's next batch
        (4, "test"),
    ]
    losses = [loss for *_, loss in full]
    assert all(math.isfinite(x) and 0 < x < 2 * math.log(256) for x in losses)
    assert len(set(losses[1:])) == 3  # other batches, other split: other losses
    assert first == full[:1]  # --exit-interval: no evaluation after training
    assert second == full[1:]  # bitwise: the resumed loader continues the validation set
