"""`get_optimizer(config, model_chunks)`: the optimizer Megatron's config asks for."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pentatron.parallel_state import ProcessGrid

from ..distributed.ddp import DistributedDataParallel
from ..distributed.fsdp import FSDP2DataParallel
from ..errors import config_error
from .config import OptimizerConfig
from .distributed_optimizer import DistributedOptimizer
from .fsdp_optimizer import FSDP2Optimizer
from .mixed_precision import GradStatsGroups, MixedPrecisionOptimizer
from .param_groups import NameCond, get_param_groups


def get_optimizer(
    config: OptimizerConfig,
    model_chunks: Sequence[DistributedDataParallel | FSDP2DataParallel],
    *,
    grid: ProcessGrid | None = None,
    stats_groups: GradStatsGroups | None = None,
    no_weight_decay_cond: NameCond | None = None,
    scale_lr_cond: NameCond | None = None,
    lr_mult: float = 1.0,
) -> MixedPrecisionOptimizer | FSDP2Optimizer:
    """Build the (distributed) mixed-precision optimizer over DDP-wrapped `model_chunks`,
    or `FSDP2Optimizer` over `FSDP2DataParallel` ones."""
    fsdp_chunks = [c for c in model_chunks if isinstance(c, FSDP2DataParallel)]
    if model_chunks and len(fsdp_chunks) == len(model_chunks):
        groups = get_param_groups(
            fsdp_chunks,
            no_weight_decay_cond,
            scale_lr_cond,
            lr_mult,
            config.decoupled_lr,
            config.decoupled_min_lr,
        )
        return FSDP2Optimizer(config, fsdp_chunks, groups, grid=grid, stats_groups=stats_groups)
    ddp_chunks: list[DistributedDataParallel] = []
    for chunk in model_chunks:
        if not isinstance(chunk, DistributedDataParallel):
            raise TypeError(
                f"model chunk {type(chunk).__name__} is not wrapped in "
                "DistributedDataParallel; fix: wrap each chunk first"
            )
        ddp_chunks.append(chunk)
        if chunk.config.use_distributed_optimizer != config.use_distributed_optimizer:
            raise config_error(
                "use_distributed_optimizer",
                config.use_distributed_optimizer,
                f"OptimizerConfig and DDPConfig disagree (DDPConfig has "
                f"{chunk.config.use_distributed_optimizer})",
                "set the same value in both",
            )
    _check_model_dtype(config, ddp_chunks)
    groups = get_param_groups(
        ddp_chunks,
        no_weight_decay_cond,
        scale_lr_cond,
        lr_mult,
        config.decoupled_lr,
        config.decoupled_min_lr,
    )
    cls = DistributedOptimizer if config.use_distributed_optimizer else MixedPrecisionOptimizer
    return cls(config, ddp_chunks, groups, grid=grid, stats_groups=stats_groups)


def _check_model_dtype(config: OptimizerConfig, chunks: Sequence[DistributedDataParallel]) -> None:
    """bf16=True / fp16=True say what the model params are (Megatron's flags): a param of
    another dtype is refused, so a model that was never cast cannot train in fp32 silently
    (or in bf16 with fp16's loss scaling)."""
    want = torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else None
    if want is None:
        return
    for chunk in chunks:
        for name, p in chunk.module.named_parameters():
            if p.requires_grad and p.dtype != want:
                flag = "bf16" if config.bf16 else "fp16"
                raise config_error(
                    flag,
                    True,
                    f"the model's params must be {want}, but {name!r} is {p.dtype}",
                    f"cast the model (`module.to({want})`) before DDP, or set {flag}=False",
                )
