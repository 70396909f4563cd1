"""`OptimizerConfig`: Megatron's optimizer fields, validated where they are declared."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import config_error

OPTIMIZERS = ("adam", "adamw", "sgd")
IMPLEMENTATIONS = ("auto", "torch", "apex")


@dataclass(frozen=True)
class OptimizerConfig:
    optimizer: str = "adam"
    """"adam" (= decoupled weight decay, AdamW, as Megatron), "adamw", or "sgd"."""
    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    """Clip to this global L2 norm; 0 disables clipping (the norm is still returned)."""
    log_num_zeros_in_grad: bool = False
    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None
    """fp16: a constant loss scale; None selects the dynamic scaler below."""
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    """Steps without inf/nan before the scale grows by 2."""
    hysteresis: int = 2
    """Overflowing steps tolerated before the scale backs off by 1/2."""
    use_distributed_optimizer: bool = False
    decoupled_lr: float | None = None
    """Peak lr of the embedding and output-layer weights (params with
    `is_embedding_or_output_parameter`), scheduled like the rest; None: they use `lr`."""
    decoupled_min_lr: float | None = None
    """Their min lr with `decoupled_lr`; None: `min_lr`."""
    optimizer_impl: str = "auto"
    """"auto": apex FusedAdam when installed on CUDA, else torch (fused on CUDA); "torch";
    "apex" (fails if apex is missing)."""

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise config_error(
                "optimizer",
                self.optimizer,
                f"must be one of {OPTIMIZERS}",
                'use optimizer="adam" (AdamW) or "sgd"',
            )
        if self.optimizer_impl not in IMPLEMENTATIONS:
            raise config_error(
                "optimizer_impl",
                self.optimizer_impl,
                f"must be one of {IMPLEMENTATIONS}",
                'use "auto"',
            )
        if self.fp16 and self.bf16:
            raise config_error(
                "fp16",
                True,
                "fp16 and bf16 are exclusive (one model dtype)",
                "set only one of fp16=True or bf16=True",
            )
        self._non_negative("lr", "min_lr", "weight_decay", "clip_grad", "sgd_momentum")
        if self.min_lr > self.lr:
            raise config_error(
                "min_lr", self.min_lr, f"must not exceed lr={self.lr}", "lower min_lr or raise lr"
            )
        self._decoupled()
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise config_error(name, value, "must lie in [0, 1)", f"e.g. {name}=0.9")
        self._positive("adam_eps", "initial_loss_scale", "min_loss_scale")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise config_error(
                "loss_scale",
                self.loss_scale,
                "must be > 0 or None",
                "set loss_scale=None for dynamic scaling",
            )
        if self.min_loss_scale > self.initial_loss_scale:
            raise config_error(
                "min_loss_scale",
                self.min_loss_scale,
                f"must not exceed initial_loss_scale={self.initial_loss_scale}",
                "lower min_loss_scale",
            )
        for name in ("loss_scale_window", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise config_error(name, value, "must be an integer >= 1", f"e.g. {name}=2")

    def _decoupled(self) -> None:
        if self.decoupled_lr is None:
            if self.decoupled_min_lr is not None:
                raise config_error(
                    "decoupled_min_lr",
                    self.decoupled_min_lr,
                    "has no effect without decoupled_lr",
                    "set decoupled_lr too, or leave decoupled_min_lr None",
                )
            return
        self._non_negative("decoupled_lr")
        low = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
        if not 0 <= low <= self.decoupled_lr:
            raise config_error(
                "decoupled_min_lr",
                low,
                f"must lie in [0, decoupled_lr={self.decoupled_lr}]",
                "lower decoupled_min_lr (or min_lr when it is None)",
            )

    def _non_negative(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise config_error(name, value, "must be a number >= 0", f"set {name} >= 0")

    def _positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise config_error(name, value, "must be a number > 0", f"set {name} > 0")
