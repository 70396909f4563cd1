"""`rms_norm` and `layer_norm` (one autograd function each) against the plain-autograd
formulas they replace: the output bitwise in fp32, bf16 and fp16; the grads against the
formula in fp64 from the same inputs; and the bytes kept for backward, counted with
saved-tensor hooks: the input in its own dtype and the fp32 per-row statistics only.
"""

import pytest
import torch
import torch.nn.functional as F

from pentatron.tp_layers import layer_norm, rms_norm

S, B, H, EPS = 16, 3, 96, 1e-5
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NORMS = ["RMSNorm", "LayerNorm"]


def _plain_rms_norm(x, weight, eps):
    """The formula before the autograd function (Hugging Face Llama's order of casts)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(weight.dtype)


def _plain_layer_norm(x, weight, bias, eps):
    out = F.layer_norm(x.to(torch.float32), (weight.numel(),), weight.float(), bias.float(), eps)
    return out.to(weight.dtype)


def _fp64_norm(norm, x, params):
    """The norm written in fp64 with no casts: the reference for the gradients."""
    if norm == "RMSNorm":
        return params[0] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))
    return F.layer_norm(x, (H,), *params, EPS)


def _inputs(dtype, trivial=False, seed=0):
    """x `[s, b, h]` (offset and scaled, so the mean and rstd matter), the params in
    `dtype` (ones / zeros when `trivial`) and an upstream grad, all exact in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(S, B, H, generator=g) + 0.5).to(dtype)
    weight = (1 + 0.3 * torch.randn(H, generator=g)).to(dtype)
    bias = (0.2 * torch.randn(H, generator=g)).to(dtype)
    if trivial:
        weight, bias = torch.ones_like(weight), torch.zeros_like(bias)
    grad = torch.randn(S, B, H, generator=g).to(dtype)
    return x, weight, bias, grad


def _params(norm, weight, bias):
    return [weight] if norm == "RMSNorm" else [weight, bias]


def _new(norm, x, params):
    return rms_norm(x, *params, EPS) if norm == "RMSNorm" else layer_norm(x, *params, EPS)


def _plain(norm, x, params):
    if norm == "RMSNorm":
        return _plain_rms_norm(x, *params, EPS)
    return _plain_layer_norm(x, *params, EPS)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("trivial", [False, True], ids=["affine", "ones-zeros"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", NORMS)
def test_forward_bitwise_equals_plain_formula(norm, dtype, trivial):
    x, weight, bias, _ = _inputs(dtype, trivial)
    params = _params(norm, weight, bias)
    out = _new(norm, x, params)
    assert out.dtype == dtype
    assert torch.equal(out, _plain(norm, x, params))


# Normwise tolerances: max |got - ref| <= tol * max |ref|, per grad. fp32: measured at most
# 2e-7 on these inputs (fp32 rounding over h = 96 terms); 1e-6 leaves room for other CPUs.
# 16-bit: the grads are computed in fp32 and rounded once to the dtype (eps/2 relative, eps
# = 2^-7 bf16, 2^-10 fp16); measured at most 0.4 eps; the bound is one eps.
GRAD_TOL = {
    torch.float32: 1e-6,
    torch.bfloat16: torch.finfo(torch.bfloat16).eps,
    torch.float16: torch.finfo(torch.float16).eps,
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", NORMS)
def test_grads_match_fp64_formula(norm, dtype, seed):
    x, weight, bias, grad = _inputs(dtype, seed=seed)
    leaves = _leaves(x, *_params(norm, weight, bias))
    got = torch.autograd.grad(_new(norm, leaves[0], leaves[1:]), leaves, grad)
    ref_leaves = [t.double() for t in _leaves(*leaves)]
    ref_leaves = _leaves(*ref_leaves)
    ref = torch.autograd.grad(_fp64_norm(norm, ref_leaves[0], ref_leaves[1:]), ref_leaves, grad)
    for name, g, r, leaf in zip(["dx", "dweight", "dbias"], got, ref, leaves):
        assert g.dtype == leaf.dtype, name
        err = (g.double() - r).abs().max() / r.abs().max()
        assert err <= GRAD_TOL[dtype], (name, err.item())


def test_grads_in_each_inputs_dtype_and_only_those_asked_for():
    """fp32 residual stream into a bf16 norm (fp32_residual_connection): dx in fp32, the
    weight grad in bf16; a frozen weight gets none."""
    x, weight, _, grad = _inputs(torch.float32)
    x, weight = _leaves(x, weight.to(torch.bfloat16))
    out = rms_norm(x, weight, EPS)
    assert out.dtype == torch.bfloat16
    out.backward(grad.to(torch.bfloat16))
    assert (x.grad.dtype, weight.grad.dtype) == (torch.float32, torch.bfloat16)
    x2, (frozen, bias) = _leaves(x)[0], _inputs(torch.float32)[1:3]
    layer_norm(x2, frozen, bias, EPS).backward(grad)
    assert x2.grad is not None and frozen.grad is None and bias.grad is None


@pytest.mark.parametrize("norm", NORMS)
def test_double_backward_fails_clearly(norm):
    x, weight, bias, grad = _inputs(torch.float32)
    leaves = _leaves(x, *_params(norm, weight, bias))
    out = _new(norm, leaves[0], leaves[1:])
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out, leaves[:1], grad, create_graph=True)


def _saved_bytes(fn, params):
    """Bytes of the distinct storages that `fn()`'s autograd graph keeps for backward, the
    parameters' own storages excluded (they are kept as themselves, not copied)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn().sum().backward()
    return sum(seen.values())


@pytest.mark.parametrize("norm", NORMS)
def test_saves_only_the_input_and_fp32_stats(norm):
    """bf16 `[s, b, h]`: the input `2 sbh` and the fp32 rstd `4 sb` (LayerNorm: + mean).
    The plain formula keeps x's fp32 copy `4 sbh` instead of x; RMSNorm also the bf16
    normalised tensor `2 sbh`, LayerNorm the fp32 copies of its weight and bias `8h`."""
    x, weight, bias, _ = _inputs(torch.bfloat16)
    leaves = _leaves(x, *_params(norm, weight, bias))
    stats = 1 if norm == "RMSNorm" else 2
    new = _saved_bytes(lambda: _new(norm, leaves[0], leaves[1:]), leaves[1:])
    assert new == S * B * H * 2 + stats * S * B * 4
    old = _saved_bytes(lambda: _plain(norm, leaves[0], leaves[1:]), leaves[1:])
    extra = S * B * H * 2 if norm == "RMSNorm" else 8 * H
    assert old == S * B * H * 4 + stats * S * B * 4 + extra
    assert old - new == (4 * S * B * H if norm == "RMSNorm" else 2 * S * B * H + 8 * H)
