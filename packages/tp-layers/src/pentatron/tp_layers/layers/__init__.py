"""Column- and row-parallel linear layers and the matmul they share."""

from .column import ColumnParallelLinear
from .linear import (
    LinearWithGradAccumulationAndAsyncCommunication,
    linear_with_grad_accumulation_and_async_allreduce,
)
from .row import RowParallelLinear

__all__ = [
    "ColumnParallelLinear",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "RowParallelLinear",
    "linear_with_grad_accumulation_and_async_allreduce",
]
