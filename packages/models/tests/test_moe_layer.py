"""Single-process MoE tests: permute/unpermute, grouped GEMM == sequential experts, the MoE layer
against a per-token loop, shared experts, GPT integration, expert sharding, bad input."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from _gpt import VOCAB, S, small_config
from _moe import moe_config, moe_spec

from pentatron.models import GPTModel, get_gpt_layer_local_spec, merge_shards, shard_full_tensor
from pentatron.models.moe.experts import GroupedMLP, SequentialMLP, grouped_mm_supported
from pentatron.models.moe.moe_layer import MoELayer, MoESubmodules
from pentatron.models.moe.permute import permute, unpermute
from pentatron.models.moe.router import TopKRouter
from pentatron.tp_layers import init_method_normal

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _routing(t=12, e=4, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(t, e, generator=g)
    top, idx = scores.topk(k, dim=-1)
    routing_map = torch.zeros(t, e, dtype=torch.bool).scatter(1, idx, True)
    probs = torch.zeros(t, e).scatter(1, idx, top / top.sum(-1, keepdim=True))
    return probs, routing_map


def test_permute_is_expert_major_and_round_trips():
    probs, rmap = _routing()
    x = torch.randn(12, 5)
    out, idx = permute(x, rmap)
    assert out.shape == (24, 5)
    expected = [t for e in range(4) for t in range(12) if rmap[t, e]]
    assert idx.tolist() == expected
    torch.testing.assert_close(unpermute(out, idx, 12, probs, rmap), x, **TOL)
    torch.testing.assert_close(unpermute(out, idx, 12), 2 * x, **TOL)  # top-2: two copies


def test_padding_to_capacity_changes_no_output():
    probs, rmap = _routing()
    x = torch.randn(12, 5)
    cap = int(rmap.sum(0).max()) + 1
    out, idx = permute(x, rmap, cap)
    assert out.shape == (4 * cap, 5)
    torch.testing.assert_close(unpermute(out, idx, 12, probs, rmap, cap), x, **TOL)
    with pytest.raises(ValueError, match="capacity"):
        permute(x, rmap, int(rmap.sum(0).max()) - 1)


def test_permute_bad_input():
    _probs, rmap = _routing()
    with pytest.raises(ValueError, match="routing_map"):
        permute(torch.randn(11, 5), rmap)
    with pytest.raises(ValueError, match="bool"):
        permute(torch.randn(12, 5), rmap.float())
    with pytest.raises(ValueError, match=r"\[T, h\]"):
        permute(torch.randn(12, 1, 5), rmap)


def _experts(cls, config, seed=0):
    torch.manual_seed(seed)
    init = init_method_normal(0.1)
    return cls(config, config.num_moe_experts, init_method=init, output_layer_init_method=init)


def _stacked_pair(config, etp_rank=0, etp_size=1):
    """SequentialMLP and GroupedMLP holding the same stacked parameters (random biases)."""
    init = init_method_normal(0.1)
    torch.manual_seed(0)
    seq = SequentialMLP(
        config,
        config.num_moe_experts,
        etp_rank=etp_rank,
        etp_size=etp_size,
        init_method=init,
        output_layer_init_method=init,
    )
    with torch.no_grad():
        for p in seq.parameters():
            if p.dim() == 2:  # biases start at zero: make them count
                p.normal_(0.0, 0.1)
    grp = GroupedMLP(config, config.num_moe_experts, etp_rank=etp_rank, etp_size=etp_size)
    grp.load_state_dict(seq.state_dict())
    return seq, grp


def _output_and_grads(module, x, counts, loss):
    x = x.detach().clone().requires_grad_(True)
    out = module(x, counts)
    params = [x, *module.parameters()]
    value = out.sum() if loss == "sum" else out.square().sum()  # "sum": zero-stride grad
    return out, torch.autograd.grad(value, params, allow_unused=True)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("etp_rank, etp_size", [(0, 1), (0, 2), (1, 2)])
@pytest.mark.parametrize("loss", ["square", "sum"])
def test_grouped_gemm_equals_sequential(activation, bias, etp_rank, etp_size, loss):
    """fp32, rtol 1e-5 / atol 1e-6 (the GEMMs may sum in another order): the output and the
    grads of the input and of every stacked parameter, with empty experts (zero tokens)
    first, inside and last, at the etp shard shapes."""
    config = moe_config(activation=activation, add_bias_linear=bias)
    seq, grp = _stacked_pair(config, etp_rank, etp_size)
    counts = [0, 3, 0, 5, 1, 2, 4, 0]
    x = torch.randn(sum(counts), config.hidden_size)
    if not grouped_mm_supported(x):
        pytest.skip("this torch build has no torch._grouped_mm for CPU fp32")
    assert grp.use_grouped_mm(x)  # the grouped kernel really runs
    a, ga = _output_and_grads(seq, x, counts, loss)
    b, gb = _output_and_grads(grp, x, counts, loss)
    torch.testing.assert_close(b, a, **TOL)
    names = ["input", *(n for n, _ in seq.named_parameters())]
    for name, u, v in zip(names, ga, gb, strict=True):
        if u is None:  # fc2's bias on etp rank 1: added on etp rank 0 only
            assert v is None and name == "linear_fc2.bias" and etp_rank == 1
            continue
        torch.testing.assert_close(v, u, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    empty = torch.tensor(counts) == 0
    for u in ga[1:]:  # the experts without tokens get exactly zero grad on both paths
        if u is not None:
            assert not u[empty].any()


def test_grouped_falls_back_to_the_identical_loop():
    """Where _grouped_mm cannot run (fp64, or rows not 16-byte aligned) GroupedMLP is the
    loop: bit-identical to SequentialMLP."""
    for config in (
        moe_config(params_dtype=torch.float64),
        moe_config(moe_ffn_hidden_size=6),  # fc2 input rows of 6 * 4 bytes
    ):
        seq, grp = _stacked_pair(config)
        dtype = config.params_dtype
        counts = [3, 0, 5, 1, 2, 0, 4, 1]
        x = torch.randn(sum(counts), config.hidden_size, dtype=dtype)
        assert not grp.use_grouped_mm(x)
        a, ga = _output_and_grads(seq, x, counts, "square")
        b, gb = _output_and_grads(grp, x, counts, "square")
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        for u, v in zip(ga, gb, strict=True):
            torch.testing.assert_close(v, u, rtol=0, atol=0)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        seq(x, counts[:-1])


def _expert_loop(experts, config, x, e):
    """Expert e of the stacked parameters as a plain dense MLP (independent of permute)."""
    fc1, fc2 = experts.linear_fc1, experts.linear_fc2
    h = F.linear(x, fc1.weight[e], fc1.bias[e])
    gate, up = torch.chunk(h, 2, dim=-1)
    return F.linear(F.silu(gate) * up, fc2.weight[e], fc2.bias[e])


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("pad", [False, True])
def test_moe_layer_equals_per_token_loop(dispatcher, pad):
    extra = (
        dict(moe_expert_capacity_factor=8.0, moe_pad_expert_input_to_capacity=True) if pad else {}
    )
    config = moe_config(moe_token_dispatcher_type=dispatcher, **extra)
    torch.manual_seed(0)
    init = init_method_normal(0.1)
    layer = MoELayer(config, MoESubmodules(router=TopKRouter), init_method=init)
    x = torch.randn(6, 2, config.hidden_size)
    out, bias = layer(x)
    assert bias is None and out.shape == x.shape
    probs, rmap = layer.router(x)
    tokens = x.reshape(-1, config.hidden_size)
    want = torch.zeros_like(tokens)
    for t in range(tokens.size(0)):
        for e in rmap[t].nonzero().flatten().tolist():
            want[t] += probs[t, e] * _expert_loop(layer.experts, config, tokens[t], e)
    torch.testing.assert_close(out.reshape(-1, config.hidden_size), want, **TOL)


@pytest.mark.parametrize("gate", [False, True])
def test_shared_experts_added(gate):
    config = moe_config(moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=gate)
    torch.manual_seed(0)
    layer = MoELayer(config, MoESubmodules(router=TopKRouter), init_method=init_method_normal(0.1))
    x = torch.randn(4, 2, config.hidden_size)
    shared = layer.shared_experts
    h = shared.linear_fc1.weight
    y = F.linear(x, h, shared.linear_fc1.bias)
    g, u = torch.chunk(y, 2, dim=-1)
    want = F.linear(F.silu(g) * u, shared.linear_fc2.weight, shared.linear_fc2.bias)
    if gate:
        assert shared.gate_weight.shape == (1, config.hidden_size)
        want = want * torch.sigmoid(x @ shared.gate_weight.t())
    layer.shared_experts = None
    routed, _ = layer(x)
    layer.shared_experts = shared
    out, _ = layer(x)
    torch.testing.assert_close(out, routed + want, **TOL)


def _shared_closed_form(shared, x):
    """SharedExpertMLP (SwiGLU, no gate) as plain F.linear calls."""
    g, u = torch.chunk(F.linear(x, shared.linear_fc1.weight, shared.linear_fc1.bias), 2, dim=-1)
    return F.linear(F.silu(g) * u, shared.linear_fc2.weight, shared.linear_fc2.bias)


def test_shared_expert_overlap_on_cpu_matches_the_closed_form():
    """moe_shared_expert_overlap with the alltoall dispatcher, one process, CPU.

    Exercised: the config path (overlap on, shared experts, alltoall dispatch/combine at
    ep=1), the layer's output and the input's gradient against an independent closed form
    (a per-token loop over the routed experts, weighted by the router's probs, plus the
    shared MLP written as F.linear calls), and bitwise equality with overlap off.
    Not exercised on CPU: the CUDA side stream (the shared experts launched before the
    dispatch, wait_stream / record_stream ordering); `_start_shared` runs nothing on CPU
    and the shared experts run after the combine, as without overlap."""
    kw = dict(moe_shared_expert_intermediate_size=24, moe_token_dispatcher_type="alltoall")
    torch.manual_seed(0)
    layer = MoELayer(
        moe_config(moe_shared_expert_overlap=True, **kw),
        MoESubmodules(router=TopKRouter),
        init_method=init_method_normal(0.1),
    )
    config = layer.config
    x = torch.randn(4, 2, config.hidden_size, requires_grad=True)
    assert layer._start_shared(x) == (None, None)  # CPU: no side stream
    out, _ = layer(x)
    (out.square().sum()).backward()
    grad = x.grad.clone()

    x.grad = None
    probs, rmap = layer.router(x)
    tokens = x.reshape(-1, config.hidden_size)
    routed = []
    for t in range(tokens.size(0)):
        experts = rmap[t].nonzero().flatten().tolist()
        assert experts, f"token {t} routed nowhere"
        routed.append(
            sum(probs[t, e] * _expert_loop(layer.experts, config, tokens[t], e) for e in experts)
        )
    want = torch.stack(routed).view_as(x) + _shared_closed_form(layer.shared_experts, x)
    want.square().sum().backward()
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(grad, x.grad, **TOL)

    plain = MoELayer(moe_config(**kw), MoESubmodules(router=TopKRouter))
    plain.load_state_dict(layer.state_dict())
    torch.testing.assert_close(plain(x)[0], out, rtol=0, atol=0)


def test_gpt_param_layout_and_dense_unchanged():
    config = moe_config(moe_layer_freq=[0, 1], moe_router_enable_expert_bias=False)
    torch.manual_seed(0)
    model = GPTModel(config, moe_spec(), VOCAB, S)
    names = dict(model.named_parameters())
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names  # dense first layer
    assert names["decoder.layers.1.mlp.router.weight"].shape == (8, 32)
    assert names["decoder.layers.1.mlp.experts.linear_fc1.weight"].shape == (8, 32, 32)
    assert names["decoder.layers.1.mlp.experts.linear_fc1.bias"].shape == (8, 32)
    assert names["decoder.layers.1.mlp.experts.linear_fc2.weight"].shape == (8, 32, 16)
    assert names["decoder.layers.1.mlp.experts.linear_fc2.bias"].shape == (8, 32)
    assert names["decoder.layers.1.mlp.experts.linear_fc2.weight"].allreduce is False
    assert getattr(names["decoder.layers.1.mlp.router.weight"], "allreduce", True)
    ids = torch.randint(0, VOCAB, (2, S))
    model(ids, labels=ids).mean().backward()
    assert names["decoder.layers.1.mlp.experts.linear_fc1.weight"].grad.abs().sum() > 0
    dense = GPTModel(small_config(num_layers=2), get_gpt_layer_local_spec(), VOCAB, S)
    assert not any(".experts." in n for n, _ in dense.named_parameters())


def test_missing_moe_spec_entry_is_a_clear_error():
    spec = get_gpt_layer_local_spec()
    spec.submodules.moe_mlp = None
    with pytest.raises(ValueError, match="moe_mlp"):
        GPTModel(moe_config(), spec, VOCAB, S)


def test_moe_layer_bad_input():
    layer = MoELayer(moe_config(), MoESubmodules(router=TopKRouter))
    with pytest.raises(ValueError, match="hidden_size"):
        layer(torch.randn(4, 31))
    with pytest.raises(ValueError, match="num_moe_experts"):
        MoELayer(small_config(), MoESubmodules(router=TopKRouter))


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_expert_shards_round_trip(activation):
    config = moe_config(activation=activation)
    ep, etp = 2, 2
    for name, shape in [
        (
            "decoder.layers.0.mlp.experts.linear_fc1.weight",
            (8, 32 if activation == "swiglu" else 16, 32),
        ),
        ("decoder.layers.0.mlp.experts.linear_fc1.bias", (8, 32 if activation == "swiglu" else 16)),
        ("decoder.layers.0.mlp.experts.linear_fc2.weight", (8, 32, 16)),
        ("decoder.layers.0.mlp.experts.linear_fc2.bias", (8, 32)),
    ]:
        full = torch.randn(shape)
        shards = [
            shard_full_tensor(
                name, full, 0, 1, config=config, ep_rank=r, ep_size=ep, etp_rank=q, etp_size=etp
            )
            for r in range(ep)
            for q in range(etp)
        ]
        assert shards[0].size(0) == 4
        torch.testing.assert_close(merge_shards(name, shards, config=config, ep_size=ep), full)
    if activation == "swiglu":  # etp rank q holds [gate_q, up_q] of every expert
        full = torch.randn(8, 32, 32)
        name = "decoder.layers.0.mlp.experts.linear_fc1.weight"
        part = shard_full_tensor(
            name, full, 0, 1, config=config, ep_rank=1, ep_size=2, etp_rank=1, etp_size=2
        )
        torch.testing.assert_close(part, torch.cat([full[4:, 8:16], full[4:, 24:32]], dim=1))
