"""GPU memory calculator (`pentatron-memory`) and its ground truth (`measure`).

Static terms replay the app's allocations exactly; activation terms are the tensors our
modules save for backward (docs/memory.md). `korthikanti_per_layer` is the textbook value.
"""

from .activations import (
    ActivationTerms,
    chunk_activations,
    korthikanti_per_layer,
    microbatches_in_flight,
    stage_activations,
)
from .plan import MemoryPlan, MemoryPlanError, derive_dp, plan_from_args
from .presets import PRESETS, from_hf_config, preset
from .report import StageMemory, memory_report
from .static import StaticBytes, chunk_parameters, static_bytes

__all__ = [
    "PRESETS",
    "ActivationTerms",
    "MemoryPlan",
    "MemoryPlanError",
    "StageMemory",
    "StaticBytes",
    "chunk_activations",
    "chunk_parameters",
    "derive_dp",
    "from_hf_config",
    "korthikanti_per_layer",
    "memory_report",
    "microbatches_in_flight",
    "plan_from_args",
    "preset",
    "stage_activations",
    "static_bytes",
]
