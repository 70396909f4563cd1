"""pentatron.parallel_state: rank grid, process groups, device/backend, traced collectives.

The multi-process test harness lives in `pentatron.parallel_state.testing`.
"""

from importlib.metadata import version as _distribution_version

from . import accessors, comm
from .accessors import *  # noqa: F403  (Megatron-named conveniences, listed in ACCESSORS)
from .accessors import ACCESSORS
from .comm import CollectiveError, Ledger, trace
from .config import DEFAULT_ORDER, DIMENSIONS, ParallelConfig, ParallelConfigError, ResolvedLayout
from .device import DeviceChoice, choose_backend, current_device
from .grid import (
    ProcessGrid,
    destroy_model_parallel,
    get_default_grid,
    gloo_threads,
    initialize_model_parallel,
    model_parallel_is_initialized,
    shutdown,
)
from .layout import ALIASES, FAMILIES, GridLayout
from .rank_generator import RankGenerator, masked_rank_groups

# the installed distribution's version, so it never drifts from pyproject.toml
__version__ = _distribution_version("pentatron-parallel-state")

__all__ = [
    "ALIASES",
    "DEFAULT_ORDER",
    "DIMENSIONS",
    "FAMILIES",
    "CollectiveError",
    "DeviceChoice",
    "GridLayout",
    "Ledger",
    "ParallelConfig",
    "ParallelConfigError",
    "ProcessGrid",
    "RankGenerator",
    "ResolvedLayout",
    "accessors",
    "choose_backend",
    "comm",
    "current_device",
    "destroy_model_parallel",
    "get_default_grid",
    "gloo_threads",
    "initialize_model_parallel",
    "masked_rank_groups",
    "model_parallel_is_initialized",
    "shutdown",
    "trace",
    *ACCESSORS,
]
