"""The schedules and `get_forward_backward_func(pp, vpp)`, which picks one as Megatron does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .common import backward_step, custom_backward, deallocate_output_tensor, forward_step
from .interleaved import forward_backward_pipelining_with_interleaving
from .no_pipelining import forward_backward_no_pipelining
from .one_f_one_b import forward_backward_pipelining_without_interleaving


def get_forward_backward_func(pp: int, vpp: int | None = None) -> Callable[..., Any]:
    """pp == 1: no pipelining; pp > 1 and vpp None: 1F1B; pp > 1 and vpp set: interleaved."""
    if pp > 1:
        if vpp is not None:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


__all__ = [
    "backward_step",
    "custom_backward",
    "deallocate_output_tensor",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "forward_step",
    "get_forward_backward_func",
]
