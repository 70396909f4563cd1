"""SwiGLU under `bias_activation_fusion`: the same numbers as the autograd form, bitwise,
and `F` fewer saved elements per token and layer (counted with saved-tensor hooks)."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from _gpt import VOCAB, S, microbatches, small_config

from pentatron.models import GPTModel, get_gpt_layer_local_spec
from pentatron.models.activations import mlp_activation, swiglu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_swiglu_bitwise_equals_autograd_form(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, 2 * 24, generator=g).to(dtype).requires_grad_()
    grad_out = torch.randn(16, 3, 24, generator=g).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    (ref_grad,) = torch.autograd.grad(ref, x, grad_out)
    x2 = x.detach().clone().requires_grad_()
    out = swiglu(x2)
    out.backward(grad_out)
    assert torch.equal(out, ref)
    assert torch.equal(x2.grad, ref_grad)


def _saved_bytes(fn, *inputs):
    """(output of `fn(*inputs)`, bytes of the distinct storages autograd keeps for its
    backward, the inputs' own excluded)."""
    skip = {t.untyped_storage().data_ptr() for t in inputs}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
        out.sum().backward()
    return out.detach(), sum(seen.values())


def test_fused_swiglu_keeps_only_fc1_output():
    """fc1 output [T, 2F] -> fc2 weight; unfused also keeps silu(gate) [T, F]."""
    tokens, ffn = 10, 12
    w1 = torch.randn(2 * ffn, 8, requires_grad=True)
    w2 = torch.randn(8, ffn, requires_grad=True)
    x = torch.randn(tokens, 8, requires_grad=True)

    def mlp(fused):
        config = small_config(ffn_hidden_size=ffn, bias_activation_fusion=fused)
        return lambda x: F.linear(mlp_activation(config, F.linear(x, w1)), w2)

    fused, plain = _saved_bytes(mlp(True), x)[1], _saved_bytes(mlp(False), x)[1]
    # fused: fc1 output (2F) and fc2's input (F); the weights are parameters of the linears
    weights = w1.numel() * 4 + w2.numel() * 4
    assert fused == weights + 4 * tokens * 3 * ffn
    assert plain - fused == 4 * tokens * ffn


def test_gelu_is_unchanged_by_the_flag():
    x = torch.randn(4, 6)
    for fused in (False, True):
        config = small_config(activation="gelu", bias_activation_fusion=fused)
        assert torch.equal(mlp_activation(config, x), F.gelu(x))


def test_gpt_fused_losses_and_grads_bitwise_equal():
    ids, pos, labels = microbatches(1)[0]
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        config = dataclasses.replace(small_config(), bias_activation_fusion=fused)
        model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, S)
        loss = model(ids, pos, labels=labels)
        loss.mean().backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def test_gqa_attention_reads_grouped_kv_without_repeating():
    """No mask: SDPA takes ng k/v heads as they are (nothing nq-wide saved for them);
    an explicit causal mask takes the repeating path: the same output within fp32."""
    from pentatron.models import DotProductAttention

    config = small_config(num_attention_heads=8, num_query_groups=2)
    attn = DotProductAttention(config, 1, 1)
    s, b, d = S, 2, config.kv_channels
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, b, 8, d, generator=g, requires_grad=True)
    k = torch.randn(s, b, 2, d, generator=g, requires_grad=True)
    v = torch.randn(s, b, 2, d, generator=g, requires_grad=True)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)  # True = masked out
    grouped, grouped_bytes = _saved_bytes(lambda q, k, v: attn(q, k, v, None), q, k, v)
    repeated, repeated_bytes = _saved_bytes(lambda q, k, v: attn(q, k, v, causal), q, k, v)
    torch.testing.assert_close(grouped, repeated, rtol=1e-5, atol=1e-6)
    # the repeating path keeps k and v at nq heads; the grouped one keeps only SDPA's output
    # and log-sum-exp besides its inputs
    assert repeated_bytes - grouped_bytes >= 2 * 4 * s * b * 8 * d
