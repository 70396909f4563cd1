"""LayerNormColumnParallelLinear (a norm fused into a column-parallel linear) vs the norm
and linear written out in one process with `torch.nn.functional`: output, and the grads of
the input, the weight shard, the bias shard and the norm's weight/bias (all-reduced over tp
by `sync_sequence_parallel_grads` under sequence parallelism). fp32, rtol 1e-5 / atol 1e-6.
tp 2 and 4, with and without SP, LayerNorm and RMSNorm, a stride-2 (SwiGLU) weight.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pentatron.tp_layers import (
    LayerNormColumnParallelLinear,
    TPConfigError,
    init_method_normal,
    layer_norm_column_parallel_linear,
    sync_sequence_parallel_grads,
    te_available,
)

TOL = {"rtol": 1e-5, "atol": 1e-6}
S, B, IN, OUT, EPS = 8, 2, 6, 16, 1e-5
CASES = [
    {"normalization": "RMSNorm", "sequence_parallel": False},
    {"normalization": "RMSNorm", "sequence_parallel": True, "stride": 2},
    {"normalization": "LayerNorm", "sequence_parallel": True},
    {"normalization": "LayerNorm", "sequence_parallel": False, "stride": 2},
]


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rows(full, r, n, stride):
    """Rank r's rows: its 1/n of each of the `stride` blocks (written here independently)."""
    return torch.cat([block.chunk(n, 0)[r] for block in full.chunk(stride, 0)], 0)


def _reference(case):
    """Output and grads of norm -> linear in plain PyTorch, all tensors full."""
    x = _randn(1, S, B, IN).requires_grad_()
    w = _randn(2, OUT, IN).requires_grad_()
    b = _randn(3, OUT).requires_grad_()
    g = (1 + 0.1 * _randn(4, IN)).requires_grad_()
    beta = (0.1 * _randn(5, IN)).requires_grad_()
    if case["normalization"] == "RMSNorm":
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * g
    else:
        h = F.layer_norm(x, (IN,), g, beta, EPS)
    out = F.linear(h, w, b)
    out.backward(_randn(6, S, B, OUT))
    return out.detach(), x.grad, w.grad, b.grad, g.grad, beta.grad


def _fused_case(case):
    n, r = dist.get_world_size(), dist.get_rank()
    stride, sp = case.get("stride", 1), case["sequence_parallel"]
    layer = LayerNormColumnParallelLinear(
        IN,
        OUT,
        tp_group=dist.group.WORLD,
        normalization=case["normalization"],
        eps=EPS,
        stride=stride,
        sequence_parallel=sp,
        init_method=init_method_normal(0.5),
    )
    with torch.no_grad():
        layer.weight.copy_(_rows(_randn(2, OUT, IN), r, n, stride))
        layer.bias.copy_(_rows(_randn(3, OUT), r, n, stride))
        layer.layer_norm_weight.copy_(1 + 0.1 * _randn(4, IN))
        if layer.layer_norm_bias is not None:
            layer.layer_norm_bias.copy_(0.1 * _randn(5, IN))
    x = _randn(1, S, B, IN)
    x = (x.chunk(n, 0)[r] if sp else x).clone().requires_grad_()
    out, bias = layer(x)
    out.backward(_rows(_randn(6, S, B, OUT).movedim(2, 0), r, n, stride).movedim(0, 2))
    sync_sequence_parallel_grads(layer, dist.group.WORLD)
    norm_bias = layer.layer_norm_bias
    return {
        "out": out.detach(),
        "bias_returned": bias,
        "x": x.grad,
        "w": layer.weight.grad,
        "b": layer.bias.grad,
        "g": layer.layer_norm_weight.grad,
        "beta": None if norm_bias is None else norm_bias.grad,
        "sp_marked": layer.layer_norm_weight.sequence_parallel,
    }


def _all_cases():
    return [_fused_case(case) for case in CASES]


@pytest.fixture(scope="module", params=[2, 4])
def fused_runs(request, distributed):
    return request.param, distributed.run(request.param, _all_cases)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_fused_norm_linear_matches_norm_then_linear(fused_runs, index):
    n, runs = fused_runs
    case = CASES[index]
    stride, sp = case.get("stride", 1), case["sequence_parallel"]
    out, x, w, b, g, beta = _reference(case)
    for r, got in enumerate(run[index] for run in runs):

        def close(name, have, want, r=r):
            torch.testing.assert_close(have, want, **TOL, msg=lambda m: f"rank {r} {name}: {m}")

        close("out", got["out"], _rows(out.movedim(2, 0), r, n, stride).movedim(0, 2))
        assert got["bias_returned"] is None and got["sp_marked"] is sp
        close("x.grad", got["x"], x.chunk(n, 0)[r] if sp else x)
        close("weight.grad", got["w"], _rows(w, r, n, stride))
        close("bias.grad", got["b"], _rows(b, r, n, stride))
        close("layer_norm_weight.grad", got["g"], g)
        if case["normalization"] == "LayerNorm":
            close("layer_norm_bias.grad", got["beta"], beta)
        else:
            assert got["beta"] is None


def test_bad_arguments_name_the_field():
    with pytest.raises(TPConfigError, match="normalization='BatchNorm'"):
        layer_norm_column_parallel_linear(4, 4, normalization="BatchNorm", backend="torch")
    with pytest.raises(TPConfigError, match="skip_weight_param_allocation"):
        LayerNormColumnParallelLinear(4, 4, tp_group=None, skip_weight_param_allocation=True)


@pytest.mark.skipif(te_available(), reason="TE is usable here")
def test_te_backend_without_te_is_a_clear_error():
    with pytest.raises(TPConfigError, match="transformer-engine"):
        layer_norm_column_parallel_linear(4, 4, normalization="RMSNorm", backend="te")
