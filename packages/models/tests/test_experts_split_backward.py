"""Routed experts under a split backward (zero-bubble pipeline schedules): inside
`WeightGradStore.defer()` B gives the undivided input gradient and no weight or bias
gradient (GroupedMLP's biases, added outside its GEMM by `experts_bias`, included); the W
then gives the undivided ones, bitwise (fp32; SwiGLU with biases, an empty expert, the loop
and the grouped GEMM where torch runs it here). GroupedMLP's bias add is also checked
against autograd's own `repeat_interleave` (its forward and both gradients, bitwise)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _moe import moe_config

from pentatron.models.moe.experts import (
    GroupedMLP,
    SequentialMLP,
    experts_bias,
    grouped_mm_supported,
)
from pentatron.tp_layers import WeightGradStore, init_method_normal

COUNTS = [3, 0, 2, 1, 2, 1, 1, 2]


def _experts(cls):
    torch.manual_seed(0)
    experts = cls(moe_config(), 8, init_method=init_method_normal(0.1))
    with torch.no_grad():
        for p in experts.parameters():
            if p.dim() == 2:  # the biases: non-zero, so a lost bias grad shows
                p.copy_(torch.randn_like(p) * 0.1)
    return experts


def _backward(experts, x, store=None):
    y = experts(x, COUNTS)
    dy = torch.linspace(-1, 1, y.numel()).view_as(y)
    if store is None:
        y.backward(dy)
        return
    with store.defer():
        y.backward(dy)
    store.close_group()


@pytest.mark.parametrize("cls", [SequentialMLP, GroupedMLP])
def test_expert_weight_gradients_wait_for_w(cls):
    ref, split = _experts(cls), _experts(cls)
    x = torch.randn(sum(COUNTS), ref.config.hidden_size, generator=torch.Generator().manual_seed(1))
    if cls is GroupedMLP and not (grouped_mm_supported(x) and split.use_grouped_mm(x)):
        pytest.skip("torch._grouped_mm does not run here: GroupedMLP is SequentialMLP's loop")
    x_ref, x_split = x.clone().requires_grad_(), x.clone().requires_grad_()
    _backward(ref, x_ref)
    store = WeightGradStore()
    _backward(split, x_split, store)
    assert torch.equal(x_split.grad, x_ref.grad)
    for name, p in split.named_parameters():
        assert p.grad is None, name
    assert store.pending_bytes() > 0
    store.run_oldest()
    for (name, p), q in zip(split.named_parameters(), ref.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name


def test_experts_bias_is_autograds_repeat_interleave_bitwise():
    counts = torch.tensor([3, 0, 2, 1, 40, 17])
    g = torch.Generator().manual_seed(2)
    h = torch.randn(int(counts.sum()), 24, generator=g)
    bias = torch.randn(len(counts), 24, generator=g)
    dy = torch.randn(h.shape, generator=g)
    h1, b1 = h.clone().requires_grad_(), bias.clone().requires_grad_()
    want = h1 + b1.repeat_interleave(counts, dim=0, output_size=h.size(0))
    want.backward(dy)
    h2, b2 = h.clone().requires_grad_(), bias.clone().requires_grad_()
    got = experts_bias(h2, b2, counts)
    got.backward(dy)
    assert torch.equal(got, want)
    assert torch.equal(h2.grad, h1.grad) and torch.equal(b2.grad, b1.grad)
