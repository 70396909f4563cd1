"""Column- and row-parallel linear layers and the matmul they share."""

from .column import ColumnParallelLinear
from .duplicated import DuplicatedLinear
from .linear import (
    LinearWithGradAccumulationAndAsyncCommunication,
    linear_with_grad_accumulation_and_async_allreduce,
)
from .norm_linear import LayerNormColumnParallelLinear
from .row import RowParallelLinear
from .te import (
    column_parallel_linear,
    layer_norm_column_parallel_linear,
    linear_backend,
    row_parallel_linear,
    te_available,
)
from .weight_grad_store import DeferredWeightGrad, WeightGradStore, deferring_store
from .wgrad import accumulate_weight_grad, placeholder_grad, wgrad_kernel

__all__ = [
    "ColumnParallelLinear",
    "DeferredWeightGrad",
    "DuplicatedLinear",
    "LayerNormColumnParallelLinear",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "RowParallelLinear",
    "WeightGradStore",
    "accumulate_weight_grad",
    "column_parallel_linear",
    "deferring_store",
    "layer_norm_column_parallel_linear",
    "linear_backend",
    "linear_with_grad_accumulation_and_async_allreduce",
    "placeholder_grad",
    "row_parallel_linear",
    "te_available",
    "wgrad_kernel",
]
