"""`DDPConfig`: how gradients are buffered, bucketed and reduced (Megatron's field names)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import config_error

DEFAULT_BUCKET_ELEMENTS = 40_000_000
"""Megatron's default: max(40M, 1M * dp) elements per bucket when overlapping."""


@dataclass(frozen=True)
class DDPConfig:
    grad_reduce_in_fp32: bool = False
    """Keep and reduce grads in fp32 even for bf16/fp16 params (4 bytes per param)."""
    overlap_grad_reduce: bool = False
    """Start a bucket's reduction in backward as soon as its last grad is ready."""
    overlap_param_gather: bool = False
    """Distributed optimizer: all-gather params asynchronously, waited in the next forward."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over dp: reduce-scatter grads, all-gather params (ZeRO-1)."""
    bucket_size: int | None = None
    """Elements per bucket; None: max(40M, 1M * dp). Without overlap there is one bucket."""
    average_in_collective: bool = False
    """Average with ReduceOp.AVG inside the collective instead of pre-scaling by 1/dp."""
    check_for_nan_in_grad: bool = False
    """Raise, naming the rank and bucket, if a grad is not finite before it is reduced."""

    def __post_init__(self) -> None:
        for name in (
            "grad_reduce_in_fp32",
            "overlap_grad_reduce",
            "overlap_param_gather",
            "use_distributed_optimizer",
            "average_in_collective",
            "check_for_nan_in_grad",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise config_error(name, value, "must be a bool", f"pass {name}=True or False")
        if self.bucket_size is not None and (
            isinstance(self.bucket_size, bool)
            or not isinstance(self.bucket_size, int)
            or self.bucket_size <= 0
        ):
            raise config_error(
                "bucket_size",
                self.bucket_size,
                "must be a positive number of elements or None",
                "e.g. bucket_size=40_000_000, or None for Megatron's default",
            )
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise config_error(
                "overlap_param_gather",
                True,
                "overlapping the param all-gather needs the distributed "
                "optimizer (without it no params are gathered)",
                "set use_distributed_optimizer=True or overlap_param_gather=False",
            )

    def resolved_bucket_size(self, dp_size: int) -> int | None:
        """Elements per bucket for `dp_size` ranks; None means one bucket per buffer."""
        if not self.overlap_grad_reduce:
            return None  # nothing to overlap with: one collective per buffer is cheapest
        if self.bucket_size is None:
            return max(DEFAULT_BUCKET_ELEMENTS, 1_000_000 * dp_size)
        return self.bucket_size
