"""pentatron.tp_layers: Megatron-style tensor- and sequence-parallel layers for any group.

Every layer and function takes its tensor-parallel group (`tp_group`: a ProcessGroup, a
1-D DeviceMesh or a `(mesh, dim)` pair); None falls back to the default grid of
`pentatron.parallel_state`.
"""

from importlib.metadata import version as _distribution_version

from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding, check_token_ids
from .grads import mark_sequence_parallel, sync_sequence_parallel_grads
from .init import init_method_normal, init_sharded_, scaled_init_method_normal, shard_of
from .layers import (
    ColumnParallelLinear,
    DeferredWeightGrad,
    DuplicatedLinear,
    LayerNormColumnParallelLinear,
    LinearWithGradAccumulationAndAsyncCommunication,
    RowParallelLinear,
    WeightGradStore,
    accumulate_weight_grad,
    column_parallel_linear,
    deferring_store,
    layer_norm_column_parallel_linear,
    linear_backend,
    linear_with_grad_accumulation_and_async_allreduce,
    row_parallel_linear,
    te_available,
    wgrad_kernel,
)
from .mappings import (
    all_to_all,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .norms import layer_norm, rms_norm
from .random import (
    DATA_PARALLEL_RNG,
    EXPERT_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    get_cuda_rng_tracker,
    get_rng_tracker,
    model_parallel_cuda_manual_seed,
    model_parallel_seed,
)
from .recompute import checkpoint
from .utils import (
    TPConfigError,
    divide,
    pad_vocab_size,
    resolve_group,
    set_tensor_model_parallel_attributes,
    split_tensor_along_last_dim,
    vocab_range,
)

# the installed distribution's version, so it never drifts from pyproject.toml
__version__ = _distribution_version("pentatron-tp-layers")

__all__ = [
    "accumulate_weight_grad",
    "wgrad_kernel",
    "te_available",
    "row_parallel_linear",
    "linear_backend",
    "column_parallel_linear",
    "layer_norm_column_parallel_linear",
    "layer_norm",
    "rms_norm",
    "LayerNormColumnParallelLinear",
    "DATA_PARALLEL_RNG",
    "EXPERT_PARALLEL_RNG",
    "MODEL_PARALLEL_RNG",
    "ColumnParallelLinear",
    "DeferredWeightGrad",
    "DuplicatedLinear",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "RNGStatesTracker",
    "RowParallelLinear",
    "TPConfigError",
    "WeightGradStore",
    "VocabParallelEmbedding",
    "all_to_all",
    "check_token_ids",
    "checkpoint",
    "copy_to_tensor_model_parallel_region",
    "deferring_store",
    "divide",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "get_cuda_rng_tracker",
    "get_rng_tracker",
    "init_method_normal",
    "init_sharded_",
    "linear_with_grad_accumulation_and_async_allreduce",
    "mark_sequence_parallel",
    "model_parallel_cuda_manual_seed",
    "model_parallel_seed",
    "pad_vocab_size",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "resolve_group",
    "scaled_init_method_normal",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "set_tensor_model_parallel_attributes",
    "shard_of",
    "split_tensor_along_last_dim",
    "sync_sequence_parallel_grads",
    "vocab_parallel_cross_entropy",
    "vocab_range",
]
