"""The schedules and `get_forward_backward_func(pp, vpp)`, which picks one as Megatron does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import PipelineConfigError
from .common import backward_step, custom_backward, deallocate_output_tensor, forward_step
from .interleaved import forward_backward_pipelining_with_interleaving
from .no_pipelining import forward_backward_no_pipelining
from .one_f_one_b import forward_backward_pipelining_without_interleaving
from .zbv import forward_backward_pipelining_zbv
from .zero_bubble_h1 import forward_backward_pipelining_zero_bubble_h1

SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv")


def get_forward_backward_func(
    pp: int, vpp: int | None = None, schedule: str | None = None
) -> Callable[..., Any]:
    """pp == 1: no pipelining; pp > 1: `schedule`, by default (None) 1F1B when vpp is None
    and interleaved when it is set, as Megatron-LM picks. A schedule that does not fit vpp
    raises PipelineConfigError before anything runs (ZBV's two chunks per rank are its
    V: vpp None or 2)."""
    if schedule is not None and schedule not in SCHEDULES:
        raise PipelineConfigError(f"schedule={schedule!r}: the rule: one of {', '.join(SCHEDULES)}")
    if pp == 1:
        return forward_backward_no_pipelining
    if schedule is None:
        schedule = "1f1b" if vpp is None else "interleaved"
    if schedule == "zbv":
        if vpp not in (None, 2):
            raise PipelineConfigError(
                f"schedule='zbv' with vpp={vpp}: the rule: ZBV runs two chunks per rank (its "
                "V); fix: vpp=None or 2"
            )
    elif (schedule == "interleaved") != (vpp is not None):
        raise PipelineConfigError(
            f"schedule={schedule!r} with vpp={vpp}: the rule: the interleaved schedule and only "
            "it runs virtual stages; fix: set vpp for 'interleaved', or vpp=None for "
            f"{schedule!r}"
        )
    return {
        "1f1b": forward_backward_pipelining_without_interleaving,
        "interleaved": forward_backward_pipelining_with_interleaving,
        "zb-h1": forward_backward_pipelining_zero_bubble_h1,
        "zbv": forward_backward_pipelining_zbv,
    }[schedule]


__all__ = [
    "SCHEDULES",
    "backward_step",
    "custom_backward",
    "deallocate_output_tensor",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_zbv",
    "forward_backward_pipelining_zero_bubble_h1",
    "forward_step",
    "get_forward_backward_func",
]
