"""`moe_router_force_load_balancing` (Megatron's RandomSTE): the router's logits are replaced
by N(0, 1) draws from the tracker's expert-parallel RNG state, and backward passes the
logits' grad straight to the gating GEMM.

With i.i.d. logits each token's top-k is a uniform k-subset of the E experts, so each
expert's count over T tokens is Binomial(T, k/E): mean T k/E, std sqrt(T k/E (1 - k/E)).
The counts are checked within 5 std (per expert P(|Z| > 5) < 6e-7); a skewed router
without the flag is far outside, so the bound discriminates.
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _moe import moe_config

from pentatron.models.moe.moe_layer import MoELayer, MoESubmodules
from pentatron.models.moe.router import TopKRouter, topk_routing
from pentatron.tp_layers import EXPERT_PARALLEL_RNG, get_rng_tracker, model_parallel_seed

H, E, K = 16, 8, 2


def _config(force=True, **kw):
    return moe_config(
        hidden_size=H,
        num_attention_heads=4,
        num_query_groups=4,
        num_moe_experts=E,
        moe_router_topk=K,
        moe_router_force_load_balancing=force,
        **kw,
    )


def _hidden(s, b=2, seed=1):
    return torch.randn(s, b, H, generator=torch.Generator().manual_seed(seed))


def _skewed_router(force):
    torch.manual_seed(0)
    router = TopKRouter(_config(force), layer_number=1)
    with torch.no_grad():
        router.weight[0] += 3.0  # every token prefers expert 0 ...
        router.weight[1] += 2.5  # ... and then expert 1
    return router


def test_counts_are_balanced_within_the_binomial_bound():
    model_parallel_seed(123, tp_rank=0)
    x = _hidden(1024)
    t = x.shape[0] * x.shape[1]
    mean, std = t * K / E, math.sqrt(t * K / E * (1 - K / E))
    counts = _skewed_router(True)(x)[1].sum(0).double()
    assert counts.sum() == t * K
    assert (counts - mean).abs().max() <= 5 * std, (counts, mean, std)
    skewed = _skewed_router(False)(x)[1].sum(0).double()
    assert (skewed - mean).abs().max() > 5 * std, skewed


def test_routing_is_topk_of_normal_draws_from_the_expert_parallel_state():
    model_parallel_seed(7, tp_rank=0)
    router, x = _skewed_router(True), _hidden(16)
    before = torch.get_rng_state()
    probs, routing_map = router(x)
    assert torch.equal(torch.get_rng_state(), before)  # the default generator is untouched
    model_parallel_seed(7, tp_rank=0)
    with get_rng_tracker().fork(EXPERT_PARALLEL_RNG):
        logits = torch.empty(x.shape[0] * x.shape[1], E).normal_()
    want_probs, want_map = topk_routing(logits, router.config)
    assert torch.equal(routing_map, want_map) and torch.equal(probs.detach(), want_probs)


def test_router_grad_passes_straight_through_and_experts_get_grads():
    """Router weight grad = (d loss / d random logits)^T x (the straight-through rule);
    every expert that got tokens has fc1 and fc2 grads."""
    model_parallel_seed(11, tp_rank=0)
    torch.manual_seed(0)
    from pentatron.tp_layers import init_method_normal

    layer = MoELayer(
        _config(), MoESubmodules(router=TopKRouter), init_method=init_method_normal(0.1)
    )
    x = _hidden(32).requires_grad_()
    out, _ = layer(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    (out * g).sum().backward()
    fc1, fc2 = layer.experts.linear_fc1.weight.grad, layer.experts.linear_fc2.weight.grad
    assert all(fc1[e].abs().sum() > 0 and fc2[e].abs().sum() > 0 for e in range(E))

    # the same step by hand: random logits as a leaf, the layer's pieces after the router
    model_parallel_seed(11, tp_rank=0)
    with get_rng_tracker().fork(EXPERT_PARALLEL_RNG):
        logits = torch.empty(x.shape[0] * x.shape[1], E).normal_().requires_grad_()
    probs, routing_map = topk_routing(logits, layer.config)
    tokens = x.detach().reshape(-1, H)
    y, counts, ctx = layer.dispatcher.dispatch(tokens, probs, routing_map)
    ref = layer.dispatcher.combine(layer.experts(y, counts), ctx)
    (ref * g.reshape(-1, H)).sum().backward()
    want = logits.grad.t() @ tokens
    torch.testing.assert_close(layer.router.weight.grad, want, rtol=1e-6, atol=1e-7)
    assert want.abs().sum() > 0
