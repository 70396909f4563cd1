"""Pieces shared by the column- and row-parallel linears: arguments, checks, parameters."""

from __future__ import annotations

from typing import Any

import torch

from pentatron.parallel_state import current_device

from ..init import InitMethod, init_method_normal, init_sharded_
from ..utils import (
    TPConfigError,
    group_rank,
    group_size,
    resolve_group,
    set_tensor_model_parallel_attributes,
)


def resolve_layer_group(tp_group: Any, is_expert: bool) -> Any:
    """The explicit group, else the default grid's "tp" (or "etp" for expert layers)."""
    if tp_group is not None or not is_expert:
        return resolve_group(tp_group)
    from pentatron.parallel_state import get_default_grid

    return get_default_grid().group("etp")


def default_init(init_method: InitMethod | None) -> InitMethod:
    return init_method if init_method is not None else init_method_normal(0.02)


def make_weight(
    shard_shape: tuple[int, int],
    full_shape: tuple[int, int],
    partition_dim: int,
    stride: int,
    init_method: InitMethod,
    group: Any,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> torch.nn.Parameter:
    """This rank's `shard_shape` of a master weight `full_shape` drawn by `init_method`;
    `group` None: not split (the whole master, a weight every tp rank holds)."""
    weight = torch.empty(
        shard_shape, dtype=dtype or torch.get_default_dtype(), device=device or current_device()
    )
    split = group is not None
    rank, size = (group_rank(group), group_size(group)) if split else (0, 1)
    init_sharded_(weight, full_shape, init_method, partition_dim, rank, size, stride)
    param = torch.nn.Parameter(weight)
    set_tensor_model_parallel_attributes(param, split, partition_dim, stride)
    return param


def make_bias(
    size: int, dtype: torch.dtype | None, device: Any, sharded: bool, stride: int = 1
) -> torch.nn.Parameter:
    """Zero bias (Megatron's choice), marked as a tp shard when `sharded`."""
    bias = torch.nn.Parameter(
        torch.zeros(
            size, dtype=dtype or torch.get_default_dtype(), device=device or current_device()
        )
    )
    set_tensor_model_parallel_attributes(bias, sharded, 0, stride)
    return bias


def check_last_dim(x: torch.Tensor, expected: int, layer: str, field: str) -> None:
    if x.dim() == 0 or x.size(-1) != expected:
        got = x.size(-1) if x.dim() else "a 0-d tensor"
        raise TPConfigError(
            f"{layer}: input last dim is {got} but {field}={expected}; the rule: the input is "
            f"[..., {field}]; fix: pass a tensor whose last dim is {expected} or build the "
            f"layer with {field}={got}"
        )
