"""`moe_router_dtype` (Megatron's --moe-router-dtype) under bf16 parameters: the gating GEMM,
top-k and probs in the router dtype, score functions in at least fp32, the expert outputs
weighted and summed in it.

References are plain PyTorch written here from the bf16 input and weight: logits
`x.to(d) @ w.to(d).T`, top-k of the logits, softmax of the top-k in max(d, fp32), probs cast
to d. Compared bitwise (same ops); the None (bf16) path is shown to differ from fp32.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _moe import moe_config

from pentatron.models.moe.load_balancing import switch_load_balancing_loss
from pentatron.models.moe.permute import permute, unpermute
from pentatron.models.moe.router import TopKRouter

H, E, K = 16, 8, 2
DTYPES = {None: torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def _router(router_dtype, **kw) -> TopKRouter:
    torch.manual_seed(0)
    config = moe_config(
        hidden_size=H,
        num_attention_heads=4,
        num_query_groups=4,
        num_moe_experts=E,
        moe_router_topk=K,
        params_dtype=torch.bfloat16,
        init_method_std=0.5,
        moe_router_dtype=router_dtype,
        **{"add_bias_linear": False, **kw},  # the references have no logit bias
    )
    return TopKRouter(config, layer_number=1)


def _hidden(s=64, b=2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(s, b, H, generator=g).to(torch.bfloat16)


def _plain_probs(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    logits = x.reshape(-1, H).to(dtype) @ w.to(dtype).t()
    top, idx = torch.topk(logits, K, dim=-1)
    top = torch.softmax(top, dim=-1, dtype=torch.promote_types(dtype, torch.float32))
    return torch.zeros_like(logits).scatter(1, idx, top.to(dtype))


@pytest.mark.parametrize("router_dtype", list(DTYPES))
def test_probs_are_the_plain_routing_in_the_router_dtype(router_dtype):
    router, x = _router(router_dtype), _hidden()
    probs, routing_map = router(x)
    want = _plain_probs(x, router.weight.detach(), DTYPES[router_dtype])
    assert probs.dtype == DTYPES[router_dtype]
    assert torch.equal(probs.detach(), want)
    assert torch.equal(routing_map, want > 0)


def test_the_bf16_path_differs_from_fp32_and_fp64_agrees_with_fp32():
    x = _hidden()
    p = {d: _router(d)(x)[0].detach().double() for d in DTYPES}
    # bf16 logits and probs: off by bf16 rounding (~1e-2 relative), not fp32's
    assert (p[None] - p["fp32"]).abs().max() > 1e-3
    assert (p["fp64"] - p["fp32"]).abs().max() < 1e-6


@pytest.mark.parametrize("router_dtype", ["fp32", "fp64"])
def test_weight_grad_and_aux_loss_in_the_router_dtype(router_dtype):
    """The weight grad is the GEMM's in the router dtype cast to bf16; the aux loss reads
    the fp32 (fp64) scores of the router-dtype logits."""
    dtype = DTYPES[router_dtype]
    router = _router(router_dtype, moe_aux_loss_coeff=0.1)
    x = _hidden()
    g = torch.randn(x.shape[0] * x.shape[1], E, generator=torch.Generator().manual_seed(2))
    probs, _ = router(x)
    (probs * g.to(dtype)).sum().backward()

    w = router.weight.detach().to(dtype).requires_grad_()
    logits = x.reshape(-1, H).to(dtype) @ w.t()
    top, idx = torch.topk(logits, K, dim=-1)
    ref_probs = torch.zeros_like(logits).scatter(1, idx, torch.softmax(top, -1))
    scores = torch.softmax(logits, -1)
    topk_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True)
    aux = switch_load_balancing_loss(scores, topk_map, K, 0.1)
    ((ref_probs * g.to(dtype)).sum() + aux).backward()
    assert router.weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(router.weight.grad, w.grad.to(torch.bfloat16), rtol=0, atol=0)
    recorded = router.aux_loss_record.mean("load_balancing_loss") * 0.1
    torch.testing.assert_close(recorded.to(dtype), aux.detach(), rtol=1e-6, atol=0)


def test_expert_outputs_are_weighted_and_summed_in_the_probs_dtype():
    """bf16 expert outputs with fp32 probs: summed in fp32, one cast to bf16 at the end
    (Megatron's unpermute); weighting in bf16 gives other numbers."""
    g = torch.Generator().manual_seed(3)
    t, h = 32, 64
    routing_map = torch.zeros(t, E, dtype=torch.bool)
    routing_map.scatter_(1, torch.rand(t, E, generator=g).topk(K, -1).indices, True)
    probs = torch.rand(t, E, generator=g) * routing_map
    tokens = torch.randn(t, h, generator=g).to(torch.bfloat16)
    y, idx = permute(tokens, routing_map)
    y = y * 1.37  # "expert outputs"
    out = unpermute(y, idx, t, probs, routing_map)
    w = probs.t().masked_select(routing_map.t())
    want = torch.zeros(t, h).index_add(0, idx, y.float() * w[:, None]).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    narrow = torch.zeros(t, h, dtype=torch.bfloat16).index_add(
        0, idx, y * w[:, None].to(torch.bfloat16)
    )
    assert not torch.equal(out, narrow)


def test_bad_router_dtype_names_the_field():
    from pentatron.models import ModelConfigError

    with pytest.raises(ModelConfigError, match=r"moe_router_dtype='bf16'.*one of"):
        moe_config(moe_router_dtype="bf16")
