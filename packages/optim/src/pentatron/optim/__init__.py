"""pentatron.optim: DDP over bucketed grad buffers, ZeRO-1 distributed optimizer, mixed
precision with loss scaling, global grad-norm clipping, and lr / wd schedules."""

from importlib.metadata import version as _distribution_version

from .checkpointing import (
    CheckpointMismatchError,
    FlatPieces,
    load_optimizer,
    save_optimizer,
    sharded_state_dict,
)
from .dcp_chunks import ChunkLoadPlanner, ChunkSavePlanner, GlobalChunks
from .distributed.ddp import DistributedDataParallel, is_expert_param
from .distributed.ddp_config import DDPConfig
from .distributed.finalize import allreduce_grads, finalize_model_grads
from .distributed.fsdp import FSDP2DataParallel, apply_fsdp2, default_blocks, local_tensor
from .distributed.grad_buffer import Bucket, BufferLayout, ParamAndGradBuffer, plan_layout
from .errors import OptimConfigError
from .optimizer.clip_grads import (
    GradSet,
    clip_grads_by_norm,
    count_zeros,
    counts_for_norm,
    found_inf_anywhere,
    global_grad_norm,
    global_grad_norm_tensor,
    unscale_and_find_inf,
)
from .optimizer.config import OptimizerConfig
from .optimizer.distributed_optimizer import DistributedOptimizer
from .optimizer.factory import get_optimizer
from .optimizer.fsdp_optimizer import FSDP2Optimizer
from .optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from .optimizer.mixed_precision import GradStatsGroups, MixedPrecisionOptimizer, StepResult
from .optimizer.param_groups import default_no_weight_decay, get_param_groups
from .scheduler import OptimizerParamScheduler, SchedulerMismatchError

# the installed distribution's version, so it never drifts from pyproject.toml
__version__ = _distribution_version("pentatron-optim")

__all__ = [
    "ChunkLoadPlanner",
    "ChunkSavePlanner",
    "GlobalChunks",
    "Bucket",
    "BufferLayout",
    "CheckpointMismatchError",
    "ConstantGradScaler",
    "DDPConfig",
    "DistributedDataParallel",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "FSDP2DataParallel",
    "FSDP2Optimizer",
    "FlatPieces",
    "GradSet",
    "GradStatsGroups",
    "MixedPrecisionOptimizer",
    "OptimConfigError",
    "OptimizerConfig",
    "OptimizerParamScheduler",
    "SchedulerMismatchError",
    "ParamAndGradBuffer",
    "StepResult",
    "allreduce_grads",
    "apply_fsdp2",
    "clip_grads_by_norm",
    "count_zeros",
    "counts_for_norm",
    "default_blocks",
    "default_no_weight_decay",
    "finalize_model_grads",
    "found_inf_anywhere",
    "global_grad_norm_tensor",
    "unscale_and_find_inf",
    "get_optimizer",
    "get_param_groups",
    "global_grad_norm",
    "is_expert_param",
    "local_tensor",
    "load_optimizer",
    "plan_layout",
    "save_optimizer",
    "sharded_state_dict",
]
