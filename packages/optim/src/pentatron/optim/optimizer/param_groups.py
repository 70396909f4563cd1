"""Param groups: no weight decay on biases and norms, optional lr multipliers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

NameCond = Callable[[str, torch.nn.Parameter], bool]


def default_no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's rule: biases and 1-D params (norm weights) get no weight decay."""
    return name.endswith(".bias") or param.dim() == 1


def get_param_groups(
    model_chunks: Sequence[torch.nn.Module],
    no_weight_decay_cond: NameCond | None = None,
    scale_lr_cond: NameCond | None = None,
    lr_mult: float = 1.0,
) -> list[dict[str, Any]]:
    """Groups of trainable params keyed by (wd_mult, lr_mult), in first-seen order."""
    no_wd = no_weight_decay_cond or default_no_weight_decay
    groups: dict[tuple[float, float], list[torch.nn.Parameter]] = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            key = (
                0.0 if no_wd(name, param) else 1.0,
                lr_mult if scale_lr_cond is not None and scale_lr_cond(name, param) else 1.0,
            )
            groups.setdefault(key, []).append(param)
    return [{"params": ps, "wd_mult": wd, "lr_mult": lr} for (wd, lr), ps in groups.items()]
