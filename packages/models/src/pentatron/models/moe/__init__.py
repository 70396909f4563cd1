"""Mixture-of-experts: router, token dispatchers, experts and the MoE layer.

The MoE layer replaces the dense MLP in the layers chosen by
``config.moe_layer_pattern()``; experts are split over the expert grid
(etp x ep x edp x pp) from ``pentatron.parallel_state``.
"""

from .experts import ExpertLinear, GroupedMLP, SequentialMLP, grouped_mm_supported
from .moe_layer import MoELayer, MoESubmodules
from .permute import permute, sort_chunks, unpermute
from .shared_experts import SharedExpertMLP
from .token_dispatcher import (
    AllGatherTokenDispatcher,
    AlltoAllTokenDispatcher,
    MoEGroups,
    build_dispatcher,
    expert_capacity,
)

__all__ = [
    "AllGatherTokenDispatcher",
    "AlltoAllTokenDispatcher",
    "ExpertLinear",
    "GroupedMLP",
    "MoEGroups",
    "MoELayer",
    "MoESubmodules",
    "SequentialMLP",
    "SharedExpertMLP",
    "build_dispatcher",
    "expert_capacity",
    "grouped_mm_supported",
    "permute",
    "sort_chunks",
    "unpermute",
]
