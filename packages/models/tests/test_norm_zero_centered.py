"""`layernorm_zero_centered_gamma` (Megatron's --apply-layernorm-1p): the norm weight `w` is
stored zero-centred (initialised to 0) and the norm scales by `1 + w`.

References are plain PyTorch written here: RMSNorm `x * rsqrt(mean(x^2) + eps) * gamma` and
`F.layer_norm(x, gamma, b)` in fp32, with gamma = w + 1. Forward is compared bitwise (fp32),
grads of the stored weight against fp64 autograd of the same formula (fp32 ~1e-6). The
Hugging Face export adds 1 to every norm weight and the import subtracts it: a zero-centred
model's logits equal transformers' Llama from the exported weights.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from _gpt import small_config

from pentatron.models import GPTModel, get_gpt_layer_local_spec
from pentatron.models.norm import Norm
from pentatron.tp_layers import LayerNormColumnParallelLinear, rms_norm

EPS = 1e-5
H = 24
NORMS = ("RMSNorm", "LayerNorm")


def _plain(norm: str, x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | None):
    """The norm written out, in x's dtype (call it with fp32 or fp64 tensors)."""
    if norm == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * gamma
    return F.layer_norm(x, (x.size(-1),), gamma, bias, EPS)


def _norm(norm: str, zero_centered: bool, seed: int = 0):
    config = small_config(
        normalization=norm, layernorm_epsilon=EPS, layernorm_zero_centered_gamma=zero_centered
    )
    module = Norm(config, H)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(5, 3, H, generator=torch.Generator().manual_seed(seed)) * 2 + 0.5


@pytest.mark.parametrize("norm", NORMS)
def test_weight_starts_at_zero_and_the_norm_is_then_the_plain_one(norm):
    zc, plain = (
        Norm(small_config(normalization=norm, layernorm_zero_centered_gamma=True), H),
        (Norm(small_config(normalization=norm), H)),
    )
    assert torch.equal(zc.weight, torch.zeros(H)) and torch.equal(plain.weight, torch.ones(H))
    x = _x()
    assert torch.equal(zc(x), plain(x))


@pytest.mark.parametrize("norm", NORMS)
def test_forward_and_weight_grad_equal_the_plain_norm_with_weight_plus_one(norm):
    module, x = _norm(norm, True), _x()
    bias = getattr(module, "bias", None)
    out = module(x)
    ref = _plain(norm, x, module.weight.detach() + 1, None if bias is None else bias.detach())
    assert torch.equal(out, ref)
    # the same weight applied as w (the rule not applied) is far off: the check discriminates
    assert (_plain(norm, x, module.weight.detach(), None if bias is None else bias.detach()) - ref
            ).abs().max() > 0.1  # fmt: skip

    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    out.backward(grad)
    w64 = module.weight.detach().double().requires_grad_()
    x64 = x.double().requires_grad_()
    b64 = None if bias is None else bias.detach().double()
    _plain(norm, x64, w64 + 1, b64).backward(grad.double())
    torch.testing.assert_close(module.weight.grad, w64.grad.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("norm", NORMS)
def test_bf16_forms_the_scale_in_fp32(norm):
    """bf16 weights: 1 + w is formed in fp32 (TE's kernels), one cast at the end."""
    module = _norm(norm, True).to(torch.bfloat16)
    x = _x().to(torch.bfloat16)
    bias = getattr(module, "bias", None)
    ref = _plain(
        norm,
        x.float(),
        module.weight.detach().float() + 1,
        None if bias is None else bias.detach().float(),
    ).to(torch.bfloat16)
    assert torch.equal(module(x), ref)


def test_fused_norm_linear_takes_the_rule():
    """The TE layout's LayerNormColumnParallelLinear (torch backend) scales by 1 + w too."""
    torch.manual_seed(0)
    layer = LayerNormColumnParallelLinear(
        H, 8, normalization="RMSNorm", eps=EPS, zero_centered_gamma=True, bias=False
    )
    assert torch.equal(layer.layer_norm_weight, torch.zeros(H))
    with torch.no_grad():
        layer.layer_norm_weight.normal_(0.0, 0.3)
    x = _x()
    out, _ = layer(x)
    normed = rms_norm(x, layer.layer_norm_weight + 1, EPS)
    assert torch.equal(out, F.linear(normed, layer.weight))


def _pair(**kw):
    """(standard, zero-centred) GPTs with the same weights (norms: gamma and gamma - 1)."""
    base = small_config(**kw)
    zc = dataclasses.replace(base, layernorm_zero_centered_gamma=True)
    models = []
    for config in (base, zc):
        torch.manual_seed(0)
        models.append(GPTModel(config, get_gpt_layer_local_spec(), 100, 16).eval())
    std, centred = models
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for (name, p), q in zip(std.named_parameters(), centred.parameters()):
            if name.endswith("layernorm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
                q.copy_(p - 1)
            else:
                assert torch.equal(p, q), name
    return std, centred


def test_gpt_with_zero_centred_norms_equals_the_standard_one():
    std, centred = _pair()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(centred(ids, None), std(ids, None), rtol=1e-6, atol=1e-6)


def test_hugging_face_export_adds_one_and_import_subtracts_it():
    transformers = pytest.importorskip("transformers")
    from pentatron.models.hf import config_to_hf, from_hf, to_hf

    _, centred = _pair(qk_layernorm=False, add_bias_linear=False)
    hf_sd = to_hf(centred)
    hf = transformers.LlamaForCausalLM(config_to_hf(centred.config, 100, 16)).eval()
    hf.load_state_dict(hf_sd)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            centred(ids, None)[..., :100], hf(ids).logits, rtol=1e-5, atol=1e-5
        )
    back = from_hf(hf, layernorm_zero_centered_gamma=True).state_dict()
    for name, p in centred.state_dict().items():
        q = back[name]
        if name.endswith("layernorm.weight"):  # (w + 1) - 1 in fp32: w up to rounding
            torch.testing.assert_close(q, p, rtol=0, atol=1e-7, msg=name)
        else:  # the padding rows past the vocabulary are zeros after import
            assert torch.equal(q[: p.size(0)][:100], p[:100]), name
