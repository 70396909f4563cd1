"""Device check `wgrad`: the weight-gradient GEMM that accumulates into an fp32 main_grad.

    python tools/device_checks/wgrad.py [--device cuda|cpu] [--tiny]

`pentatron.tp_layers.layers.wgrad.accumulate_weight_grad(main_grad, grad_output_2d,
input_2d)` adds dY^T X (dY `[T, out]`, X `[T, in]`, bf16) into main_grad `[out, in]`
(fp32), and `wgrad_kernel(device, dtype)` names the path it takes. On CUDA in bf16 at
T = 8192 tokens, in = 2048, out = 5632 (the issue model's fc1-sized weight grad):
- one call onto a random fp32 main_grad C0 equals the fp64 reference C0 + dY^T X within
  max|err| <= 1e-4 * max|dY^T X| (fp32 accumulation of exact bf16 products; a product
  rounded to bf16 before the add would show ~1e-3);
- a second call accumulates: C0 + 2 dY^T X within twice that;
- the kernels of one call (torch.profiler) include no fp32 SIMT GEMM (`sgemm`, `simt`,
  f32 operands on FFMA: `_kernels.is_fp32_simt_gemm`); their names are printed;
- time per call, medians of 20, and its TFLOP/s (2 T in out FLOPs).
Without the module (not merged yet) it prints `not available` and exits 0 (N/A).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import _paths  # noqa: F401
from _kernels import device_kernels, is_fp32_simt_gemm

TOL = 1e-4


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    try:
        from pentatron.tp_layers.layers.wgrad import accumulate_weight_grad, wgrad_kernel
    except ImportError as e:
        print(f"pentatron.tp_layers.layers.wgrad not available: {e}")
        print("RESULT " + json.dumps({"status": "N/A", "note": "wgrad module not available"}))
        return 0

    import torch

    dev = torch.device(args.device)
    tokens, d_in, d_out = (256, 64, 176) if args.tiny else (8192, 2048, 5632)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, d_in, device=dev, generator=g).to(torch.bfloat16)
    dy = torch.randn(tokens, d_out, device=dev, generator=g).to(torch.bfloat16)
    c0 = torch.randn(d_out, d_in, device=dev, generator=g)
    product = dy.double().t() @ x.double()
    scale = product.abs().max().item()
    path = wgrad_kernel(dev, torch.bfloat16)

    main_grad = c0.clone()
    accumulate_weight_grad(main_grad, dy, x)
    err1 = (main_grad.double() - (c0.double() + product)).abs().max().item() / scale
    accumulate_weight_grad(main_grad, dy, x)
    err2 = (main_grad.double() - (c0.double() + 2 * product)).abs().max().item() / scale
    dtype_ok = main_grad.dtype == torch.float32

    kernels: list[str] = []
    if dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            accumulate_weight_grad(main_grad, dy, x)
            torch.cuda.synchronize()
        kernels = sorted(device_kernels(prof))
    simt = [k for k in kernels if is_fp32_simt_gemm(k)]

    times = []
    for _ in range(25):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        accumulate_weight_grad(main_grad, dy, x)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    call_s = statistics.median(times[5:])
    ok = err1 <= TOL and err2 <= 2 * TOL and dtype_ok and not simt
    out = {
        "path": path,
        "shape": {"tokens": tokens, "in": d_in, "out": d_out},
        "rel_error_1_call": err1,
        "rel_error_2_calls": err2,
        "tolerance": TOL,
        "main_grad_fp32": dtype_ok,
        "kernels": kernels,
        "fp32_simt_gemms": simt,
        "call_ms": call_s * 1e3,
        "tflops": 2 * tokens * d_in * d_out / call_s / 1e12,
    }
    print(f"path {path!r}: rel error {err1:.1e} (1 call), {err2:.1e} (2 calls), "
          f"tolerance {TOL:g}; {call_s * 1e3:.3f} ms/call, {out['tflops']:.0f} TFLOP/s")  # fmt: skip
    for k in kernels:
        print(f"  kernel: {k}{'   <- fp32 SIMT GEMM' if k in simt else ''}")
    print("RESULT " + json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
