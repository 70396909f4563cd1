"""SwiGLU under torch.compile: the fused function (whose backward writes into one buffer
with `out=`, which Dynamo cannot trace) gives way to its autograd form, so a compiled MLP
has no graph break; the compiler chooses what to keep for backward. Same numbers as the
fused function eagerly (fp32; rtol 1e-6: the compiled graph may reorder the product)."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from pentatron.models.activations import mlp_activation


def test_compiled_swiglu_has_no_graph_break_and_the_fused_numbers():
    from torch._dynamo.utils import counters

    config = SimpleNamespace(
        activation="swiglu",
        gated_linear_unit=True,
        bias_activation_fusion=True,
        activation_func=F.silu,
        glu_linear_offset=0.0,
        activation_func_clamp_value=None,
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, 2 * 24, generator=g)
    grad_out = torch.randn(16, 3, 24, generator=g)
    results = []
    torch._dynamo.reset()
    counters.clear()
    for fn in (mlp_activation, torch.compile(mlp_activation, backend="aot_eager")):
        xi = x.clone().requires_grad_()
        out = fn(config, xi)
        out.backward(grad_out)
        results.append((out.detach(), xi.grad))
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)
