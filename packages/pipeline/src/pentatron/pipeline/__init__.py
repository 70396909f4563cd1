"""pentatron.pipeline: p2p between pipeline stages, no-pipelining / 1F1B / interleaved /
zero-bubble (ZB-H1) schedules, the schedule table, stage layout (and Megatron's custom layout
strings), timelines and bubble accounting."""

from importlib.metadata import version as _distribution_version

from .bubble import BubbleReport, bubble_report, ideal_bubble_fraction
from .config import PipelineConfig, PipelineConfigError, check_schedule, tensor_shape
from .custom_layout import PipelineLayout, parse_layout_string
from .layout import StageLayout
from .p2p import P2PCommunicator
from .schedule_table import (
    Op,
    get_schedule_table,
    phase_counts,
    rank_schedule,
    warmup_count,
)
from .schedules import (
    SCHEDULES,
    backward_step,
    custom_backward,
    deallocate_output_tensor,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    forward_backward_pipelining_zbv,
    forward_backward_pipelining_zero_bubble_h1,
    forward_step,
    get_forward_backward_func,
)
from .timeline import Event, ScheduleDeadlock, Timeline, simulate, simulate_ops, to_chrome_trace
from .zero_bubble import v_stage, zb_h1_bubble_fraction, zb_h1_rank_schedule, zbv_schedules

# the installed distribution's version, so it never drifts from pyproject.toml
__version__ = _distribution_version("pentatron-pipeline")

__all__ = [
    "BubbleReport",
    "Event",
    "Op",
    "P2PCommunicator",
    "PipelineConfig",
    "PipelineConfigError",
    "PipelineLayout",
    "SCHEDULES",
    "ScheduleDeadlock",
    "StageLayout",
    "Timeline",
    "__version__",
    "backward_step",
    "bubble_report",
    "check_schedule",
    "custom_backward",
    "deallocate_output_tensor",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_zbv",
    "forward_backward_pipelining_zero_bubble_h1",
    "forward_step",
    "get_forward_backward_func",
    "get_schedule_table",
    "ideal_bubble_fraction",
    "parse_layout_string",
    "phase_counts",
    "rank_schedule",
    "simulate",
    "simulate_ops",
    "v_stage",
    "zb_h1_bubble_fraction",
    "zb_h1_rank_schedule",
    "zbv_schedules",
    "tensor_shape",
    "to_chrome_trace",
    "warmup_count",
]
