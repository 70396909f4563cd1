"""Micro-batches per step, with Megatron's optional batch-size ramp-up.

`--rampup-batch-size START INCR SAMPLES`: the global batch starts at START and grows by
INCR each SAMPLES / ((GBS - START) / INCR) consumed samples until it reaches GBS.
"""

from __future__ import annotations


def global_batch_size(args, consumed_samples: int) -> int:
    if args.rampup_batch_size is None:
        return args.global_batch_size
    start, incr, ramp_samples = args.rampup_batch_size
    steps = max((args.global_batch_size - start) // incr, 1)
    per_step = ramp_samples / steps
    return min(start + int(consumed_samples / per_step) * incr, args.global_batch_size)


def num_microbatches(args, consumed_samples: int) -> int:
    return global_batch_size(args, consumed_samples) // (
        args.micro_batch_size * args.data_parallel_size
    )
