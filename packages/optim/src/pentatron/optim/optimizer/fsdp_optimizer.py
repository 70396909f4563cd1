"""`FSDP2Optimizer`: the optimizer step over FSDP2-sharded (`DTensor`) params.

FSDP2 already holds what `MixedPrecisionOptimizer` builds: each rank's params are its fp32
dp shard (the main params; compute runs in `param_dtype` after FSDP2's all-gather) and the
grads arrive reduce-scattered and averaged. So the inner torch optimizer steps the
`DTensor` params directly and its state is sharded the same way (ZeRO-3). The global grad
norm is the one Megatron clips by: each rank sums the squares of its local grad shards
(tp duplicates counted on tp rank 0 only, tied copies not at all), then all-reduce over
tp-pp and dp-cp (expert params: etp-ep-pp and edp). fp16 loss scaling is not offered:
FSDP2 runs bf16 or fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pentatron.parallel_state import ProcessGrid, get_default_grid

from ..distributed.ddp import is_expert_param
from ..distributed.fsdp import FSDP2DataParallel, local_tensor
from ..errors import config_error
from .clip_grads import (
    GradSet,
    agree_has_experts,
    clip_grads_by_norm,
    count_zeros,
    counts_for_norm,
    global_grad_norm,
)
from .config import OptimizerConfig
from .mixed_precision import GradStatsGroups, StepResult, make_inner_optimizer


class FSDP2Optimizer:
    """Optimizer over `FSDP2DataParallel` chunks; `param_groups` as from `get_param_groups`."""

    is_sharded = True
    grad_scaler = None

    def __init__(
        self,
        config: OptimizerConfig,
        model_chunks: Sequence[FSDP2DataParallel],
        param_groups: list[dict[str, Any]],
        *,
        grid: ProcessGrid | None = None,
        stats_groups: GradStatsGroups | None = None,
    ) -> None:
        if config.fp16:
            raise config_error(
                "fp16", True, "FSDP2 trains in bf16 or fp32 (no loss scaling)", "use bf16"
            )
        if config.use_distributed_optimizer:
            raise config_error(
                "use_distributed_optimizer",
                True,
                "FSDP2 shards the optimizer state itself",
                "drop the distributed optimizer with FSDP2",
            )
        self.config = config
        self.model_chunks = list(model_chunks)
        self.stats = stats_groups or GradStatsGroups.from_grid(grid or get_default_grid(), True)
        self.params = [p for g in param_groups for p in g["params"]]
        inner_groups = [
            {
                **g,
                "lr": config.lr * g.get("lr_mult", 1.0),
                "weight_decay": config.weight_decay * g.get("wd_mult", 1.0),
            }
            for g in param_groups
        ]
        self.optimizer = make_inner_optimizer(config, inner_groups)
        self.num_skipped_steps = 0
        # agreed by every rank: a pipeline rank of dense layers holds no expert params
        self._has_experts = agree_has_experts(any(is_expert_param(p) for p in self.params), grid)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def get_loss_scale(self) -> float:
        return 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def _grad_sets(self) -> list[GradSet]:
        def local_grads(expert: bool, tp_rank: int) -> list[torch.Tensor]:
            return [
                local_tensor(p.grad)
                for p in self.params
                if is_expert_param(p) == expert and counts_for_norm(p, tp_rank)
            ]

        sets = [GradSet(local_grads(False, self.stats.tp_rank), self.stats.dense)]
        if self._has_experts:
            sets.append(GradSet(local_grads(True, self.stats.expert_tp_rank), self.stats.expert))
        return sets

    @torch.no_grad()
    def step(self) -> StepResult:
        """One step after `finalize_model_grads`: norm, clip, inner step."""
        for p in self.params:
            if p.grad is None:  # unused this step: still decayed, like DDP's zero main_grad
                p.grad = torch.zeros_like(p)
        sets = self._grad_sets()
        grad_norm = global_grad_norm(sets)
        if self.config.clip_grad > 0:
            clip_grads_by_norm([p.grad for p in self.params], self.config.clip_grad, grad_norm)
        zeros = count_zeros(sets) if self.config.log_num_zeros_in_grad else None
        self.optimizer.step()
        return StepResult(True, grad_norm, zeros, None)

    def zero_grad(self) -> None:
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state (`DTensor` shards): torch.distributed.checkpoint."""
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
