"""Loss scalers for fp16 (Megatron's `ConstantGradScaler` / `DynamicGradScaler`).

Dynamic rule, once per step with `found_inf` agreed by every rank:
- overflow: reset the growth count; after `hysteresis` overflowing steps (not necessarily
  consecutive: the counter is refilled only on growth) scale <- max(scale * backoff, min);
- no overflow: after `growth_interval` clean steps in a row, scale <- scale * growth and
  the hysteresis budget is refilled.
"""

from __future__ import annotations

from typing import Any


class ConstantGradScaler:
    def __init__(self, scale: float) -> None:
        self.scale = float(scale)

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler(ConstantGradScaler):
    def __init__(
        self,
        initial_scale: float = 2.0**32,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ) -> None:
        if not (
            initial_scale > 0
            and min_scale > 0
            and growth_factor > 1.0
            and 0.0 < backoff_factor < 1.0
            and growth_interval >= 1
            and hysteresis >= 1
        ):
            raise ValueError(
                "DynamicGradScaler needs initial_scale > 0, min_scale > 0, growth_factor > 1, "
                "0 < backoff_factor < 1, growth_interval >= 1, hysteresis >= 1; got "
                f"{initial_scale}, {min_scale}, {growth_factor}, {backoff_factor}, "
                f"{growth_interval}, {hysteresis}"
            )
        super().__init__(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])
