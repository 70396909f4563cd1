"""Shared pieces of the MoE tests: a small MoE config and a stand-in router used only when
`pentatron.models.moe.router` is not there yet."""

from __future__ import annotations

import torch
from _gpt import small_config

try:
    from pentatron.models.moe.router import TopKRouter
except ImportError:  # pragma: no cover - until the router lands

    class TopKRouter(torch.nn.Module):  # type: ignore[no-redef]
        """Softmax top-k over `weight [E, h]`; probs zero off route (stand-in)."""

        def __init__(self, config, layer_number: int = 1, tp_cp_group=None) -> None:
            super().__init__()
            self.config = config
            e, h = config.num_moe_experts, config.hidden_size
            self.weight = torch.nn.Parameter(torch.empty(e, h))
            torch.nn.init.normal_(self.weight, std=config.init_method_std)
            if config.sequence_parallel:
                self.weight.sequence_parallel = True

        def forward(self, hidden):
            logits = hidden.reshape(-1, hidden.size(-1)) @ self.weight.t()
            scores = torch.softmax(logits.float(), dim=-1)
            top, idx = scores.topk(self.config.moe_router_topk, dim=-1)
            routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True)
            probs = torch.zeros_like(scores).scatter(1, idx, top)
            return probs, routing_map


def moe_config(**overrides):
    """2 layers, 8 experts top-2, SwiGLU with biases, every layer MoE."""
    base = dict(
        num_layers=2,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
    )
    base.update(overrides)
    return small_config(**base)


def moe_spec():
    """The local GPT spec with this module's router (the real TopKRouter once it exists)."""
    from pentatron.models import get_gpt_layer_local_spec
    from pentatron.models.moe.moe_layer import MoESubmodules

    spec = get_gpt_layer_local_spec()
    spec.submodules.moe_mlp.submodules = MoESubmodules(router=TopKRouter)
    return spec
