"""The parallel linears under torch.compile: one graph, and the weight gradient handed to
autograd instead of accumulated into `main_grad`.

A traced backward cannot write to a tensor outside its graph, so under Dynamo the linear
returns dW like an unfused layer and a DDP wrapper's post-accumulate-grad hook adds it to
`main_grad`. Checked on one process (tp=1) against the eager, fused layer: the same dW (fp32;
rtol 1e-6: `addmm_` into zeros vs a plain GEMM), `main_grad` untouched, no graph break.
"""

import torch

from pentatron.tp_layers import ColumnParallelLinear, RowParallelLinear


class _Pair(torch.nn.Module):
    """column -> row, as in an MLP: `[s, b, 8]` -> `[s, b, 8]`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = ColumnParallelLinear(8, 12, bias=True)
        self.fc2 = RowParallelLinear(12, 8, bias=True, input_is_parallel=True)
        for w in (self.fc1.weight, self.fc2.weight):  # what DDP sets
            w.main_grad = torch.zeros_like(w)
            w.grad_added_to_main_grad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)[0]))[0]


def _backward(model: _Pair, x: torch.Tensor) -> None:
    model(x).square().sum().backward()


def test_compiled_linears_return_the_weight_grad():
    import torch._dynamo
    from torch._dynamo.utils import counters

    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(1))
    fused = _Pair()
    _backward(fused, x)
    weights = (fused.fc1.weight, fused.fc2.weight)
    assert all(w.grad_added_to_main_grad for w in weights)  # eager: dW is in main_grad

    torch._dynamo.reset()
    counters.clear()
    compiled = _Pair()
    compiled.compile(backend="aot_eager")
    _backward(compiled, x)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1
    for eager_w, w in zip(weights, (compiled.fc1.weight, compiled.fc2.weight)):
        assert not w.grad_added_to_main_grad
        assert torch.count_nonzero(w.main_grad) == 0
        torch.testing.assert_close(w.grad, eager_w.main_grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(compiled.fc1.bias.grad, fused.fc1.bias.grad)
