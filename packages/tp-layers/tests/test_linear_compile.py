"""The parallel linears under torch.compile: one graph, and gradient-accumulation fusion
kept, as one operator of the traced backward (`weight_grad_into_main_grad`).

A traced backward can neither write a tensor outside its graph nor set an attribute, so
the fused weight gradient runs as an operator the compiler does not look into: at run
time it accumulates into the parameter's `main_grad` with the eager kernel, sets DDP's
`grad_added_to_main_grad` and hands autograd the shared placeholder. Checked on one
process (tp=1) against the eager, fused layers, bf16 weights with fp32 `main_grad` (what
`--bf16` trains; also fp32, and bf16 through Inductor, whose generated code calls the
operator and returns its output as is), three micro-batches whose forwards all run before their backwards (a
pipeline's order): `main_grad` equal bitwise (the same kernels run in the same order; the
old compiled path, dW returned in bf16 and added by the hook, is off by bf16's rounding),
the flag set, no gradient allocated, no graph break. Without DDP's flag the fused path
returns no gradient, which an operator cannot, so dW is returned as by an unfused layer.
"""

import pytest
import torch

from pentatron.tp_layers import ColumnParallelLinear, RowParallelLinear
from pentatron.tp_layers.layers.wgrad import placeholder_grad


class _Pair(torch.nn.Module):
    """column -> row, as in an MLP: `[s, b, 8]` -> `[s, b, 8]`."""

    def __init__(self, dtype: torch.dtype, ddp_flag: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = ColumnParallelLinear(8, 12, bias=True, params_dtype=dtype)
        self.fc2 = RowParallelLinear(12, 8, bias=True, input_is_parallel=True, params_dtype=dtype)
        self.seen: list[tuple[bool, int]] = []  # per hook call: (flag, grad's data_ptr)
        for w in self.weights:  # what DDP sets
            w.main_grad = torch.zeros_like(w, dtype=torch.float32)
            if ddp_flag:
                w.grad_added_to_main_grad = False
                w.register_post_accumulate_grad_hook(self._hook)

    @property
    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc1.weight, self.fc2.weight

    def _hook(self, w: torch.Tensor) -> None:
        """DDP's, reduced to what it reads: the flag, and the gradient it then drops."""
        self.seen.append((w.grad_added_to_main_grad, w.grad.data_ptr()))
        w.grad, w.grad_added_to_main_grad = None, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)[0]))[0]


def _micro_batches(model: _Pair, dtype: torch.dtype) -> None:
    """Three micro-batches, every forward before the first backward."""
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 2, 8, generator=gen).to(dtype) for _ in range(3)]
    for out in [model(x) for x in xs]:
        out.float().square().sum().backward()


def _compiled(
    dtype: torch.dtype, ddp_flag: bool = True, backend: str = "aot_eager"
) -> tuple[_Pair, dict]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _Pair(dtype, ddp_flag)
    model.compile(backend=backend)
    _micro_batches(model, dtype)
    return model, {"breaks": sum(counters["graph_break"].values()), **counters["stats"]}


@pytest.mark.parametrize(
    ("dtype", "backend"),
    [(torch.bfloat16, "aot_eager"), (torch.float32, "aot_eager"), (torch.bfloat16, "inductor")],
)
def test_compiled_linears_accumulate_into_main_grad_as_eager_ones(dtype, backend):
    eager = _Pair(dtype)
    _micro_batches(eager, dtype)
    compiled, dynamo = _compiled(dtype, backend=backend)
    assert dynamo["breaks"] == 0 and dynamo["unique_graphs"] == 1, dynamo
    for w_eager, w in zip(eager.weights, compiled.weights):
        assert torch.count_nonzero(w.main_grad) == w.numel()
        assert torch.equal(w.main_grad, w_eager.main_grad)
        assert w.grad is None
    # every hook saw the flag and the shared placeholder: no dW-sized tensor per call
    shared = {placeholder_grad(w).data_ptr() for w in compiled.weights}
    assert compiled.seen == eager.seen and len(compiled.seen) == 6
    assert all(flag and ptr in shared for flag, ptr in compiled.seen), compiled.seen
    torch.testing.assert_close(compiled.fc1.bias.grad, eager.fc1.bias.grad, rtol=0, atol=0)


def test_without_ddp_the_compiled_linears_return_the_weight_grad():
    eager = _Pair(torch.float32, ddp_flag=False)
    _micro_batches(eager, torch.float32)
    assert all(w.grad is None for w in eager.weights)  # eager fused: dW is in main_grad only
    compiled, dynamo = _compiled(torch.float32, ddp_flag=False)
    assert dynamo["breaks"] == 0 and dynamo["unique_graphs"] == 1, dynamo
    for w_eager, w in zip(eager.weights, compiled.weights):
        assert torch.count_nonzero(w.main_grad) == 0
        # the same sums: three addmm_ into main_grad against a GEMM per micro-batch, added
        torch.testing.assert_close(w.grad, w_eager.main_grad, rtol=1e-6, atol=1e-7)
