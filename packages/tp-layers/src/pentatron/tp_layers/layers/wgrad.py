"""The weight-gradient GEMM of gradient-accumulation fusion: `main_grad += dY^T X`.

    dY [T, o] (bf16/fp16/fp32), X [T, i] (same dtype), main_grad [o, i] (usually fp32)

On a GPU the GEMM must run on tensor cores: bf16/fp16 operands, fp32 accumulation, fp32
result added into `main_grad`, as Megatron's `wgrad_gemm_accum_fp32` kernel does. Widening the
operands to fp32 first (`main_grad.addmm_(dY.float().t(), X.float())`) gives the same sum
but runs as an fp32 SIMT GEMM at a fraction of the speed and copies both activations.

Paths, best first; `wgrad_kernel(device, dtype)` says which one a device takes (probed once
per device type and dtype, on tiny tensors, so a torch that lacks or breaks an overload
falls back rather than fails):
- "baddbmm_out_dtype": one cuBLAS call, `baddbmm(out=main_grad, out_dtype=fp32)`,
  accumulating in place (torch's `baddbmm.dtype_out`, CUDA).
- "mm_out_dtype_add": the GEMM with an fp32 result (`mm.dtype`), then one add into
  `main_grad` (a transient of main_grad's size).
- "addmm_fp32": operands widened to fp32 (the CPU, which has no low-precision GEMM with an
  fp32 result). Products of bf16 or fp16 values are exact in fp32, so every path sums the
  same exact products in fp32 and they differ only in summation order (tested).
- "addmm": operands already in main_grad's dtype (an fp32 model, or bf16 main grads).
"""

from __future__ import annotations

from typing import Any

import torch

_LOW = (torch.bfloat16, torch.float16)
_CHOSEN: dict[tuple[str, torch.dtype], str] = {}


def _baddbmm_accumulate(main: torch.Tensor, grad_2d: torch.Tensor, input_2d: torch.Tensor) -> None:
    out = main.view(1, *main.shape)
    torch.baddbmm(out, grad_2d.t()[None], input_2d[None], out_dtype=main.dtype, out=out)


def _mm_then_add(main: torch.Tensor, grad_2d: torch.Tensor, input_2d: torch.Tensor) -> None:
    main.add_(torch.mm(grad_2d.t(), input_2d, out_dtype=main.dtype))


def _widened(main: torch.Tensor, grad_2d: torch.Tensor, input_2d: torch.Tensor) -> None:
    main.addmm_(grad_2d.t().to(main.dtype), input_2d.to(main.dtype))


def _same_dtype(main: torch.Tensor, grad_2d: torch.Tensor, input_2d: torch.Tensor) -> None:
    main.addmm_(grad_2d.t(), input_2d)


_PATHS: dict[str, Any] = {
    "baddbmm_out_dtype": _baddbmm_accumulate,
    "mm_out_dtype_add": _mm_then_add,
    "addmm_fp32": _widened,
    "addmm": _same_dtype,
}


def _works(path: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Run `path` on [5, 3] x [5, 4] -> [3, 4]; on a device with data, check the sum."""
    g = torch.arange(15, dtype=torch.float32).reshape(5, 3).sub_(7).div_(4)
    x = torch.arange(20, dtype=torch.float32).reshape(5, 4).sub_(9).div_(8)
    start = torch.full((3, 4), 0.5)
    main = start.to(device)
    try:
        _PATHS[path](main, g.to(device, dtype), x.to(device, dtype))
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    if device.type == "meta":
        return tuple(main.shape) == (3, 4) and main.dtype == torch.float32
    expected = start + g.to(dtype).float().t() @ x.to(dtype).float()  # exact in fp32 here
    return bool(torch.equal(main.cpu(), expected))


def wgrad_kernel(device: torch.device | str, dtype: torch.dtype) -> str:
    """The path `accumulate_weight_grad` takes for `dtype` operands into fp32 on `device`."""
    device = torch.device(device)
    if dtype not in _LOW:
        return "addmm"
    key = (device.type, dtype)
    if key not in _CHOSEN:
        candidates = ("baddbmm_out_dtype", "mm_out_dtype_add") if device.type != "cpu" else ()
        _CHOSEN[key] = next((p for p in candidates if _works(p, device, dtype)), "addmm_fp32")
    return _CHOSEN[key]


def accumulate_weight_grad(
    main_grad: torch.Tensor, grad_output_2d: torch.Tensor, input_2d: torch.Tensor
) -> None:
    """`main_grad [o, i] += grad_output_2d[T, o]^T @ input_2d [T, i]`, on tensor cores where
    the device has them (see the module docstring for the paths)."""
    dtype = grad_output_2d.dtype
    if dtype == main_grad.dtype or main_grad.dtype != torch.float32:
        if dtype != main_grad.dtype:  # e.g. bf16 main grads with fp32 activations
            _widened(main_grad, grad_output_2d, input_2d)
        else:
            _same_dtype(main_grad, grad_output_2d, input_2d)
        return
    _PATHS[wgrad_kernel(main_grad.device, dtype)](main_grad, grad_output_2d, input_2d)


_DUMMIES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def placeholder_grad(weight: torch.Tensor) -> torch.Tensor:
    """A tensor of `weight`'s shape, dtype and device that nobody reads, without allocating.

    A layer that accumulated dW into `main_grad` still hands autograd a gradient, so that
    DDP's post-accumulate-grad hook fires for the weight (on autograd's own thread, as
    Megatron requires); the hook sees `grad_added_to_main_grad` and drops it. It is a fresh
    view of one shared, never-written buffer per (device, dtype): autograd adopts a tensor
    nobody else references as the param's `.grad` without copying it, so nothing is
    allocated or zeroed per layer and micro-batch.
    """
    key = (weight.device, weight.dtype)
    buf = _DUMMIES.get(key)
    if buf is None or buf.numel() < weight.numel():
        buf = torch.empty(weight.numel(), dtype=weight.dtype, device=weight.device)
        _DUMMIES[key] = buf
    return buf[: weight.numel()].view(weight.shape)
