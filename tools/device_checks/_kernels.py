"""GPU kernel names from torch.profiler, and what they say (shared by the device checks).

- `device_kernels(prof)`: {kernel name: total GPU microseconds, launches} of a finished
  `torch.profiler.profile` (the device-side events, CUDA kernels, memcpy and memset);
- `is_fp32_simt_gemm(name)`: a GEMM on CUDA cores in fp32 (cuBLAS `sgemm`, CUTLASS
  `simt`, or an xmma/cutlass GEMM whose operands are f32f32 computed by `ffma`), the
  kind a bf16 model must never launch: it runs at a fraction of the tensor cores' rate.
  TF32 GEMMs (`tf32` in the name) are tensor-core GEMMs and do not count;
- `is_nccl(name)`: an NCCL collective kernel;
- `sdpa_backend(names)`: which SDPA kernel family ran: cudnn, flash, efficient (CUTLASS
  memory-efficient), or math (none of those: bmm + softmax kernels).
"""

from __future__ import annotations

from typing import Any

_GEMM_WORDS = ("gemm", "matmul", "cutlass", "xmma", "gemv")


def is_fp32_simt_gemm(name: str) -> bool:
    n = name.lower()
    if "tf32" in n:
        return False
    if "sgemm" in n or ("simt" in n and any(w in n for w in _GEMM_WORDS)):
        return True
    gemm = any(w in n for w in _GEMM_WORDS)
    return gemm and ("f32f32_f32f32" in n or ("ffma" in n and "f32" in n))


def is_nccl(name: str) -> bool:
    return "nccl" in name.lower()


def sdpa_backend(names: list[str]) -> str:
    low = [n.lower() for n in names]
    if any("cudnn" in n and ("sdpa" in n or "fmha" in n or "flash" in n) for n in low):
        return "cudnn"
    if any("flash" in n for n in low):
        return "flash"
    if any("memeff" in n or "fmha_cutlass" in n or "efficient" in n for n in low):
        return "efficient"
    return "math"


def device_kernels(prof: Any) -> dict[str, dict[str, float]]:
    """{name: {"us": total GPU time, "calls": launches}} of the profile's device events."""
    from torch.autograd import DeviceType

    out: dict[str, dict[str, float]] = {}
    for evt in prof.events():
        if evt.device_type != DeviceType.CUDA:
            continue
        row = out.setdefault(evt.name, {"us": 0.0, "calls": 0})
        row["us"] += evt.time_range.elapsed_us()
        row["calls"] += 1
    return out


def summarize(kernels: dict[str, dict[str, float]], top: int = 15) -> dict[str, Any]:
    """Top kernels by GPU time and the shares of fp32 SIMT GEMMs and NCCL in the total."""
    total = sum(r["us"] for r in kernels.values()) or 1.0
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1]["us"])
    simt = {n: r for n, r in kernels.items() if is_fp32_simt_gemm(n)}
    nccl = {n: r for n, r in kernels.items() if is_nccl(n)}
    return {
        "total_gpu_ms": total / 1e3,
        "kernels": len(kernels),
        "top": [
            {"name": n, "ms": r["us"] / 1e3, "calls": int(r["calls"]), "share": r["us"] / total}
            for n, r in ranked[:top]
        ],
        "fp32_simt_gemm_share": sum(r["us"] for r in simt.values()) / total,
        "fp32_simt_gemm_kernels": sorted(simt),
        "nccl_share": sum(r["us"] for r in nccl.values()) / total,
    }


def table(summary: dict[str, Any], width: int = 110) -> str:
    """The top kernels as fixed-width text lines."""
    lines = [f"{'ms':>9} {'share':>6} {'calls':>6}  kernel"]
    for row in summary["top"]:
        name = row["name"] if len(row["name"]) <= width else row["name"][: width - 3] + "..."
        lines.append(f"{row['ms']:9.2f} {row['share']:6.1%} {row['calls']:6d}  {name}")
    return "\n".join(lines)


def cpu_ops(prof: Any) -> dict[str, dict[str, float]]:
    """{op: {"us": self CPU time, "calls"}}: what a CPU-only profile has instead of kernels
    (the smoke run's stand-in, so the same summary code runs without a GPU)."""
    return {
        e.key: {"us": float(e.self_cpu_time_total), "calls": int(e.count)}
        for e in prof.key_averages()
        if e.self_cpu_time_total > 0
    }
