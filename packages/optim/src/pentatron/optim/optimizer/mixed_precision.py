"""`MixedPrecisionOptimizer`: fp32 main params next to bf16/fp16 (or fp32) model params.

One step: copy model grads (`param.main_grad`, dp-reduced) to the main params; fp16:
unscale and agree on inf/nan over the whole grid (skip the step everywhere and back the
scale off if any); global grad norm and clipping; the inner torch optimizer steps the main
params; main params are written back to the model (rounded to its dtype).
`DistributedOptimizer` reuses this with the main params being this rank's dp shard.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from pentatron.parallel_state import ProcessGrid, get_default_grid

from ..distributed.ddp import DistributedDataParallel, is_expert_param
from .clip_grads import (
    GradSet,
    agree_has_experts,
    clip_grads_by_norm,
    count_zeros,
    counts_for_norm,
    global_grad_norm,
    unscale_and_find_inf,
)
from .config import OptimizerConfig
from .grad_scaler import ConstantGradScaler, DynamicGradScaler

logger = logging.getLogger("pentatron.optim")


@dataclass(frozen=True)
class GradStatsGroups:
    """Groups over which grad statistics are completed (see `clip_grads`)."""

    dense: tuple[Any, ...]
    expert: tuple[Any, ...]
    found_inf: tuple[Any, ...]
    tp_rank: int = 0
    expert_tp_rank: int = 0

    @classmethod
    def from_grid(cls, grid: ProcessGrid, sharded: bool) -> GradStatsGroups:
        dense = (grid.group("tp-pp"),) + ((grid.group("dp-cp"),) if sharded else ())
        expert = (grid.group("etp-ep-pp"),) + ((grid.group("edp"),) if sharded else ())
        # tp-pp x dp-cp is every rank: an overflow anywhere skips the step everywhere.
        found_inf = (grid.group("tp-pp"), grid.group("dp-cp"))
        return cls(dense, expert, found_inf, grid.rank("tp"), grid.rank("etp"))


class StepResult(NamedTuple):
    update_successful: bool
    grad_norm: float | None
    num_zeros_in_grad: int | None
    loss_scale: float | None


@dataclass(eq=False)
class MainParam:
    """What the inner optimizer updates for (part of) one model param."""

    model_param: torch.nn.Parameter
    main: torch.Tensor  # fp32, updated by the inner optimizer
    grad: torch.Tensor  # view of the (reduced) grad buffer, same numel as `main`
    target: torch.Tensor  # view of the model param's storage that `main` is written to
    owns_storage: bool  # False: `main` is `target` itself (fp32 model), no copy needed
    expert: bool


def _main_param(param: torch.nn.Parameter, grad: torch.Tensor, target: torch.Tensor) -> MainParam:
    if target.dtype == torch.float32:
        return MainParam(param, target, grad, target, False, is_expert_param(param))
    main = target.detach().float().clone()
    return MainParam(param, main, grad, target, True, is_expert_param(param))


def _main_grad(mp: MainParam) -> torch.Tensor:
    """`mp.main.grad`, which `_copy_grads_to_main` sets at the start of every step."""
    grad = mp.main.grad
    if grad is None:
        raise RuntimeError(
            f"main param of a {tuple(mp.model_param.shape)} param has no grad: the step "
            "reads main grads only after _copy_grads_to_main"
        )
    return grad


def make_inner_optimizer(
    config: OptimizerConfig, groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """torch AdamW/SGD (fused on CUDA), or apex FusedAdam when installed and selected."""
    cuda = any(p.is_cuda for g in groups for p in g["params"])
    if config.optimizer in ("adam", "adamw"):
        if config.optimizer_impl in ("auto", "apex"):
            try:
                from apex.optimizers import FusedAdam  # optional, GPU only
            except ImportError:
                if config.optimizer_impl == "apex":
                    raise ImportError(
                        "optimizer_impl='apex' but apex is not installed; fix: "
                        "install NVIDIA apex from source or use 'auto'"
                    ) from None
            else:
                if cuda:
                    return FusedAdam(
                        groups,
                        lr=config.lr,
                        weight_decay=config.weight_decay,
                        betas=(config.adam_beta1, config.adam_beta2),
                        eps=config.adam_eps,
                        adam_w_mode=True,
                    )
        kwargs = {"fused": True} if cuda else {}
        return torch.optim.AdamW(
            groups,
            lr=config.lr,
            weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            **kwargs,
        )
    return torch.optim.SGD(
        groups, lr=config.lr, weight_decay=config.weight_decay, momentum=config.sgd_momentum
    )


class MixedPrecisionOptimizer:
    """Optimizer over DDP-wrapped model chunks; `param_groups` as from `get_param_groups`."""

    def __init__(
        self,
        config: OptimizerConfig,
        model_chunks: Sequence[DistributedDataParallel],
        param_groups: list[dict[str, Any]],
        *,
        grid: ProcessGrid | None = None,
        stats_groups: GradStatsGroups | None = None,
    ) -> None:
        self.config = config
        self.model_chunks = list(model_chunks)
        if stats_groups is None:
            stats_groups = GradStatsGroups.from_grid(grid or get_default_grid(), self.is_sharded)
        self.stats = stats_groups
        self.main_params = self._build_main_params()
        self._has_experts = agree_has_experts(
            any(mp.expert for mp in self.main_params)
            or any(chunk.expert_buffers for chunk in self.model_chunks),
            grid,
        )
        by_param: dict[torch.nn.Parameter, list[MainParam]] = {}
        for mp in self.main_params:
            by_param.setdefault(mp.model_param, []).append(mp)
        inner_groups = []
        for g in param_groups:
            mains = [mp.main for p in g["params"] for mp in by_param.get(p, [])]
            inner_groups.append(
                {
                    **g,
                    "params": mains,
                    "lr": config.lr * g.get("lr_mult", 1.0),
                    "weight_decay": config.weight_decay * g.get("wd_mult", 1.0),
                }
            )
        self.optimizer = make_inner_optimizer(config, inner_groups)
        self.grad_scaler: ConstantGradScaler | None = None
        self.num_skipped_steps = 0
        """Steps skipped because of inf/nan grads (the same count on every rank)."""
        if config.fp16:
            self.grad_scaler = (
                ConstantGradScaler(config.loss_scale)
                if config.loss_scale
                else DynamicGradScaler(
                    config.initial_loss_scale,
                    config.min_loss_scale,
                    growth_interval=config.loss_scale_window,
                    hysteresis=config.hysteresis,
                )
            )

    is_sharded = False

    def _build_main_params(self) -> list[MainParam]:
        out = []
        for chunk in self.model_chunks:
            for buffer in chunk.all_buffers:
                for p in buffer.params:
                    # torch stubs lack DDP's .main_grad
                    out.append(_main_param(p, p.main_grad, p.data))  # type: ignore[attr-defined]
        return out

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    # --- loss scale --------------------------------------------------------------------
    def get_loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.get_loss_scale()

    # --- step --------------------------------------------------------------------------
    def _grad_sets(self) -> list[GradSet]:
        dense = [
            _main_grad(mp)
            for mp in self.main_params
            if not mp.expert and counts_for_norm(mp.model_param, self.stats.tp_rank)
        ]
        expert = [
            _main_grad(mp)
            for mp in self.main_params
            if mp.expert and counts_for_norm(mp.model_param, self.stats.expert_tp_rank)
        ]
        sets = [GradSet(dense, self.stats.dense)]
        if self._has_experts:  # agreed by every rank at construction
            sets.append(GradSet(expert, self.stats.expert))
        return sets

    def _copy_grads_to_main(self) -> None:
        for mp in self.main_params:
            grad = mp.grad.view_as(mp.main)
            mp.main.grad = grad if grad.dtype == torch.float32 else grad.float()

    @torch.no_grad()
    def step(self) -> StepResult:
        """One optimizer step after `finalize_model_grads`; a skipped step returns False."""
        self._copy_grads_to_main()
        grads = [_main_grad(mp) for mp in self.main_params]
        scale = None
        if self.grad_scaler is not None:
            scale = self.grad_scaler.scale
            found_inf = unscale_and_find_inf(
                grads, self.grad_scaler.inv_scale, self.stats.found_inf
            )
            self.grad_scaler.update(found_inf)
            if found_inf:
                self.num_skipped_steps += 1
                logger.warning(
                    "inf/nan in the grads on some rank: step skipped on every rank "
                    "(loss scale %g -> %g, %d skipped so far)",
                    scale,
                    self.grad_scaler.scale,
                    self.num_skipped_steps,
                )
                self._clear_main_grads()
                return StepResult(False, None, None, scale)
        sets = self._grad_sets()
        grad_norm = global_grad_norm(sets)
        if self.config.clip_grad > 0:
            clip_grads_by_norm(grads, self.config.clip_grad, grad_norm)
        zeros = count_zeros(sets) if self.config.log_num_zeros_in_grad else None
        self.optimizer.step()
        self._clear_main_grads()
        self._write_back()
        return StepResult(True, grad_norm, zeros, scale)

    def _clear_main_grads(self) -> None:
        for mp in self.main_params:
            mp.main.grad = None

    def _write_back(self) -> None:
        pairs = [
            (mp.target, mp.main.view_as(mp.target)) for mp in self.main_params if mp.owns_storage
        ]
        if pairs:  # one multi-tensor copy (rounding fp32 -> the model dtype), not one per param
            targets, mains = zip(*pairs)
            torch._foreach_copy_(list(targets), list(mains))

    def zero_grad(self) -> None:
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()

    # --- checkpoint --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: inner optimizer, fp32 main params it owns, the loss scaler."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "main_params": [
                mp.main.clone() if mp.owns_storage else None for mp in self.main_params
            ],
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["main_params"]) != len(self.main_params):
            raise ValueError(
                f"checkpoint holds {len(state['main_params'])} main params, this optimizer "
                f"{len(self.main_params)}; fix: load it into the same model and dp layout"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for mp, saved in zip(self.main_params, state["main_params"]):
                if saved is not None:
                    mp.main.copy_(saved)
        if self.grad_scaler is not None and state.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
