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
    decoupled_lr: float | None = None,
    decoupled_min_lr: float | None = None,
) -> list[dict[str, Any]]:
    """Groups of trainable params keyed by (wd_mult, lr_mult, decoupled), in first-seen order.

    With `decoupled_lr`, params tagged `is_embedding_or_output_parameter` (the word
    embedding and output layer, as Megatron) form their own groups whose `max_lr` is
    `decoupled_lr` and `min_lr` `decoupled_min_lr` (when given); the scheduler reads both."""
    no_wd = no_weight_decay_cond or default_no_weight_decay
    groups: dict[tuple[float, float, bool], list[torch.nn.Parameter]] = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            key = (
                0.0 if no_wd(name, param) else 1.0,
                lr_mult if scale_lr_cond is not None and scale_lr_cond(name, param) else 1.0,
                decoupled_lr is not None
                and getattr(param, "is_embedding_or_output_parameter", False),
            )
            groups.setdefault(key, []).append(param)
    out: list[dict[str, Any]] = []
    for (wd, lr, decoupled), ps in groups.items():
        group: dict[str, Any] = {"params": ps, "wd_mult": wd, "lr_mult": lr}
        group["is_decoupled_lr"] = decoupled  # Megatron's key: loggers report the others' lr
        if decoupled:
            group["max_lr"] = decoupled_lr
            if decoupled_min_lr is not None:
                group["min_lr"] = decoupled_min_lr
        out.append(group)
    return out
