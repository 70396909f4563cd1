"""`OptimizerParamScheduler`: Megatron's lr warm-up + decay and weight-decay ramp.

lr at step n (per param group, then times its `lr_mult`):
- warm-up, n <= W (W > 0): init_lr + (max_lr - init_lr) * n / W;
- constant: max_lr; past the decay steps D: min_lr;
- inverse-square-root: max(min_lr, max_lr * sqrt(max(W, 1)) / sqrt(max(n, 1)));
- else with r = (n - W) / (D - W): min_lr + c * (max_lr - min_lr), c = 1 - r (linear),
  (cos(pi r) + 1) / 2 (cosine), or WSD: 1 until D - wsd_decay_steps, then the
  `lr_wsd_decay_style` curve (linear, cosine, exponential 2*0.5^q - 1, minus_sqrt 1 - sqrt q)
  over q = (n - (D - wsd_decay_steps)) / wsd_decay_steps.
wd at step n (times the group's `wd_mult`): end_wd past `wd_incr_steps`, else
start_wd + c * (end_wd - start_wd) with c = n / S (linear) or (cos(pi (1 - n/S)) + 1) / 2.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import config_error

LR_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_STYLES = ("constant", "linear", "cosine")
_CHECKPOINT_FIELDS = (
    "max_lr",
    "min_lr",
    "lr_warmup_steps",
    "lr_decay_steps",
    "lr_decay_style",
    "start_wd",
    "end_wd",
    "wd_incr_steps",
    "wd_incr_style",
)


class SchedulerMismatchError(ValueError):
    """A checkpoint's schedule `field` differs from this run's, and neither
    `use_checkpoint_opt_param_scheduler` nor `override_opt_param_scheduler` says which wins
    (Megatron's rule). `mine` / `saved` are the two values, for an app to name its flags."""

    def __init__(self, field: str, mine: Any, saved: Any) -> None:
        self.field, self.mine, self.saved = field, mine, saved
        super().__init__(
            f"scheduler field {field}: this run has {mine!r}, the checkpoint {saved!r}; fix: "
            "pass use_checkpoint_opt_param_scheduler=True to take the checkpoint's, or "
            "override_opt_param_scheduler=True to keep this run's"
        )


class OptimizerParamScheduler:
    def __init__(
        self,
        optimizer: Any,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: bool = True,
        override_opt_param_scheduler: bool = False,
        wsd_decay_steps: int | None = None,
        lr_wsd_decay_style: str | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.init_lr, self.max_lr, self.min_lr = float(init_lr), float(max_lr), float(min_lr)
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps, self.lr_wsd_decay_style = wsd_decay_steps, lr_wsd_decay_style
        self.start_wd, self.end_wd = float(start_wd), float(end_wd)
        self.wd_incr_steps, self.wd_incr_style = wd_incr_steps, wd_incr_style
        self.use_checkpoint = use_checkpoint_opt_param_scheduler
        self.override = override_opt_param_scheduler
        if self.override and self.use_checkpoint:
            raise config_error(
                "override_opt_param_scheduler",
                True,
                "cannot both override and use the checkpoint's schedule",
                "set use_checkpoint_opt_param_scheduler=False",
            )
        self._validate()
        self.num_steps = 0
        self.step(0)

    def _validate(self) -> None:
        if self.lr_decay_style not in LR_STYLES:
            raise config_error(
                "lr_decay_style",
                self.lr_decay_style,
                f"must be one of {LR_STYLES}",
                'e.g. "cosine"',
            )
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise config_error(
                "min_lr", self.min_lr, f"need 0 <= min_lr <= max_lr={self.max_lr}", "lower min_lr"
            )
        if self.lr_warmup_steps < 0 or self.lr_decay_steps <= 0:
            raise config_error(
                "lr_decay_steps",
                self.lr_decay_steps,
                "need lr_decay_steps > 0 and lr_warmup_steps >= 0",
                "e.g. lr_decay_steps = total training steps",
            )
        if self.lr_warmup_steps >= self.lr_decay_steps:
            raise config_error(
                "lr_warmup_steps",
                self.lr_warmup_steps,
                f"must be below lr_decay_steps={self.lr_decay_steps}",
                "shorten the warm-up or lengthen the decay",
            )
        if self.lr_decay_style == "WSD" and (
            self.lr_wsd_decay_style not in WSD_STYLES
            or not self.wsd_decay_steps
            or not 0 < self.wsd_decay_steps <= self.lr_decay_steps - self.lr_warmup_steps
        ):
            raise config_error(
                "wsd_decay_steps",
                self.wsd_decay_steps,
                "WSD needs 0 < wsd_decay_steps <= lr_decay_steps - "
                f"lr_warmup_steps and lr_wsd_decay_style in {WSD_STYLES}",
                'e.g. wsd_decay_steps=lr_decay_steps // 10, "linear"',
            )
        if self.wd_incr_style not in WD_STYLES:
            raise config_error(
                "wd_incr_style",
                self.wd_incr_style,
                f"must be one of {WD_STYLES}",
                'e.g. "constant"',
            )
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise config_error(
                "end_wd",
                self.end_wd,
                f"constant weight decay needs start_wd == end_wd (start_wd={self.start_wd})",
                "set both equal or pick linear",
            )
        if self.wd_incr_style != "constant" and self.wd_incr_steps <= 0:
            raise config_error(
                "wd_incr_steps",
                self.wd_incr_steps,
                "a weight-decay ramp needs wd_incr_steps > 0",
                "set it > 0",
            )

    def get_wd(self) -> float:
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = self.num_steps / self.wd_incr_steps
        coeff = (
            ratio
            if self.wd_incr_style == "linear"
            else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        )
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr(self, param_group: dict[str, Any]) -> float:
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        n, warm, decay = self.num_steps, self.lr_warmup_steps, self.lr_decay_steps
        if warm > 0 and n <= warm:
            return self.init_lr + (max_lr - self.init_lr) * n / warm
        if self.lr_decay_style == "constant":
            return max_lr
        if n > decay:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            return max(min_lr, max_lr * max(warm, 1) ** 0.5 / max(n, 1) ** 0.5)
        ratio = (n - warm) / (decay - warm)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            coeff = self._wsd_coeff(n)
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self, n: int) -> float:
        assert self.wsd_decay_steps is not None
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if n <= anneal_start:
            return 1.0
        q = (n - anneal_start) / self.wsd_decay_steps
        style = self.lr_wsd_decay_style
        if style == "linear":
            return 1.0 - q
        if style == "cosine":
            return 0.5 * (math.cos(math.pi * q) + 1.0)
        if style == "exponential":
            return 2.0 * math.pow(0.5, q) - 1.0
        return 1.0 - math.sqrt(q)

    def step(self, increment: int = 1) -> None:
        """Advance `increment` steps and set every param group's lr and weight_decay."""
        self.num_steps += increment
        wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    # --- checkpoint --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {name: getattr(self, name) for name in _CHECKPOINT_FIELDS}
        state["num_steps"] = self.num_steps
        return state

    def _check_and_set(self, name: str, saved: Any) -> Any:
        """Override: keep ours. Use checkpoint: take its. Neither: they must agree."""
        mine = getattr(self, name)
        if self.override:
            return mine
        if not self.use_checkpoint and mine != saved:
            raise SchedulerMismatchError(name, mine, saved)
        return saved

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in _CHECKPOINT_FIELDS:
            setattr(self, name, self._check_and_set(name, state[name]))
        self._validate()
        self.num_steps = 0
        self.step(int(state["num_steps"]))
