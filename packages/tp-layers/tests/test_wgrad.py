"""The fused weight-gradient accumulation: `main_grad += dY^T X` in the operands' dtype.

Reference: the same bf16/fp16 operands multiplied in fp64 (every product of two bf16 or fp16
values is exact in fp32 too, so the fused sum differs from it only by fp32 summation:
relative error <= T * 2^-24 of the sum of |terms|; we assert 8 * T * 2^-24 there). The
unfused bf16 path (`dY^T X` rounded to bf16, then added) is shown to be far off that bound,
so the test can tell a fused fp32 accumulation from a bf16 one.
"""

import pytest
import torch

from pentatron.tp_layers import accumulate_weight_grad, wgrad_kernel
from pentatron.tp_layers.layers.linear import linear_with_grad_accumulation_and_async_allreduce
from pentatron.tp_layers.layers.wgrad import _DUMMIES, placeholder_grad

T, OUT, IN = 96, 24, 40


def _operands(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(T, OUT, generator=g).to(dtype)
    x = torch.randn(T, IN, generator=g).to(dtype)
    return dy, x


def _bound(dy, x):
    """8 * T * 2^-24 * (sum over tokens of |dY_t o x_t|): fp32 summation error, generous."""
    return 8 * T * 2.0**-24 * (dy.double().abs().t() @ x.double().abs())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_accumulation_matches_exact_products(dtype):
    dy, x = _operands(dtype)
    start = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(5))
    main = start.clone()
    accumulate_weight_grad(main, dy, x)
    accumulate_weight_grad(main, dy, x)  # micro-batches accumulate
    exact = start.double() + 2 * (dy.double().t() @ x.double())
    err = (main.double() - exact).abs()
    assert (err <= 2 * _bound(dy, x) + 2.0**-24 * start.double().abs()).all(), err.max()
    # Rounding dW to the operands' dtype (the unfused path) would break that bound:
    unfused = start.double() + 2 * (dy.t() @ x).double()
    assert ((unfused - exact).abs() > 2 * _bound(dy, x)).any()


def test_fp32_operands_accumulate_in_place():
    dy, x = _operands(torch.float32)
    main = torch.zeros(OUT, IN)
    accumulate_weight_grad(main, dy, x)
    torch.testing.assert_close(main, dy.t() @ x, rtol=1e-6, atol=1e-6)
    assert wgrad_kernel("cpu", torch.float32) == "addmm"


def test_kernel_choice_per_device():
    # The CPU has no low-precision GEMM with an fp32 result: operands are widened.
    assert wgrad_kernel("cpu", torch.bfloat16) == "addmm_fp32"
    # A device with tensor cores (meta stands in for it here) keeps bf16 operands.
    assert wgrad_kernel("meta", torch.bfloat16) in ("baddbmm_out_dtype", "mm_out_dtype_add")


def test_meta_path_multiplies_in_bf16():
    """On a tensor-core device the GEMM's operands stay bf16 (no fp32 SIMT GEMM)."""
    from pentatron.parallel_state.testing.fake_device import FakeDevice

    main = torch.zeros(OUT, IN, device="meta")
    dy, x = (t.to("meta") for t in _operands(torch.bfloat16))
    with FakeDevice(compute_dtype=torch.bfloat16) as dev:
        accumulate_weight_grad(main, dy, x)
    assert dev.gemms and all(d == torch.bfloat16 for r in dev.gemms for d in r.dtypes)
    with (
        pytest.raises(AssertionError, match="fp32 GEMM"),
        FakeDevice(compute_dtype=torch.bfloat16),
    ):  # the widened CPU path, planted on the device, is caught
        main.addmm_(dy.t().float(), x.float())


def test_fused_layer_grads_match_unfused():
    """The parallel linear's matmul (tp group of one) with fusion into an fp32 main_grad vs
    without (weight.grad from autograd), fp32 activations: the same dW."""
    group = None  # no process group: one rank, no communication
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2, IN, generator=g, requires_grad=True)
    dy = torch.randn(6, 2, OUT, generator=g)
    w_ref = torch.nn.Parameter(torch.randn(OUT, IN, generator=g))
    w = torch.nn.Parameter(w_ref.detach().clone())
    w.main_grad = torch.zeros(OUT, IN)
    out_ref = linear_with_grad_accumulation_and_async_allreduce(
        x, w_ref, None, False, False, False, group
    )
    out = linear_with_grad_accumulation_and_async_allreduce(x, w, None, True, False, False, group)
    out_ref.backward(dy)
    out.backward(dy)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    torch.testing.assert_close(w.main_grad, w_ref.grad, rtol=1e-6, atol=1e-6)
    assert w.grad is None  # fused: autograd got nothing to accumulate


def test_placeholder_grad_is_adopted_without_copy():
    """With DDP's marker, the layer hands autograd a view of one shared buffer; autograd
    adopts it as .grad without cloning, so no weight-sized tensor is made per call."""
    group = None  # no process group: one rank, no communication
    w = torch.nn.Parameter(torch.randn(OUT, IN))
    w.main_grad = torch.zeros(OUT, IN)
    w.grad_added_to_main_grad = False
    seen = []
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.untyped_storage().data_ptr()))
    for _ in range(2):
        x = torch.randn(3, 2, IN, requires_grad=True)
        linear_with_grad_accumulation_and_async_allreduce(
            x, w, None, True, False, False, group
        ).sum().backward()
        assert w.grad_added_to_main_grad
        w.grad, w.grad_added_to_main_grad = None, False
    shared = _DUMMIES[(w.device, w.dtype)].untyped_storage().data_ptr()
    assert seen == [shared, shared]
    assert placeholder_grad(w).shape == w.shape
