"""Shared pieces of the MoE tests: a small MoE config and the local GPT spec with the
real `TopKRouter` (imported directly: a missing router must fail the tests, not be
replaced by a stand-in)."""

from __future__ import annotations

from _gpt import small_config

from pentatron.models.moe.router import TopKRouter


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


def moe_spec(multi_latent_attention: bool = False):
    """The local GPT spec with the MoE layer's router set explicitly to `TopKRouter`."""
    from pentatron.models import get_gpt_layer_local_spec
    from pentatron.models.moe.moe_layer import MoESubmodules

    spec = get_gpt_layer_local_spec(True, multi_latent_attention=multi_latent_attention)
    spec.submodules.moe_mlp.submodules = MoESubmodules(router=TopKRouter)
    return spec
