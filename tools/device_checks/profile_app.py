"""Device check `profile`: where the training app's GPU time goes, from torch.profiler.

    python tools/device_checks/profile_app.py -- <pentatron-pretrain flags>

Runs `pentatron.pretrain.pretrain_gpt.pretrain(args)` in this process (the arguments
parsed and validated as the app's `main` does; the process group from torchrun's
environment, or a world of one) under `torch.profiler.profile` with the schedule
wait 1 / warm-up 1 / active `--active` iterations, stepped from the metrics logger after
every iteration (so --log-interval is irrelevant and nothing in the app changes). From
the device-side events of the active iterations it prints the top 15 kernels by total GPU
time, the share of GPU time in fp32 SIMT GEMMs (`_kernels.is_fp32_simt_gemm`: 'sgemm',
'simt', f32 operands on FFMA) and the share in NCCL kernels, and `RESULT {json}`.
On a CPU-only run (`--device cpu`, the smoke mode) the same summary is made of the CPU
ops' self time, so the wiring is proven without a GPU. Pass `--train-iters` >=
2 + `--active`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import _paths  # noqa: F401
from _kernels import cpu_ops, device_kernels, summarize, table


class SteppingLogger:
    """The app's logger, plus `prof.step()` after every logged iteration."""

    def __init__(self, inner, prof) -> None:
        self._inner, self._prof = inner, prof

    def log_train(self, iteration, metrics) -> None:
        self._inner.log_train(iteration, metrics)
        self._prof.step()

    def __getattr__(self, name):
        return getattr(self._inner, name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--active", type=int, default=2, help="profiled iterations")
    p.add_argument("app_flags", nargs=argparse.REMAINDER)
    ns = p.parse_args()
    flags = [f for f in ns.app_flags if f != "--"]

    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from pentatron.pretrain.arguments import parse_args, validate_args
    from pentatron.pretrain.pretrain_gpt import default_logger, pretrain

    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29513")):  # fmt: skip
        os.environ.setdefault(var, value)
    cuda = torch.cuda.is_available()
    args = validate_args(parse_args(flags), int(os.environ["WORLD_SIZE"]), cuda=cuda)
    on_gpu = args.device == "cuda" or (args.device == "auto" and cuda)
    if args.train_iters < 2 + ns.active:
        print(f"--train-iters {args.train_iters}: needs >= 2 + --active {ns.active}")
        return 2
    activities = [ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    sched = schedule(wait=1, warmup=1, active=ns.active, repeat=1)
    with profile(activities=activities, schedule=sched) as prof:
        state = pretrain(args, logger_factory=lambda a, g, c: SteppingLogger(
            default_logger(a, g, c), prof))  # fmt: skip
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    kernels = device_kernels(prof) if on_gpu else cpu_ops(prof)
    summary = summarize(kernels)
    summary["source"] = "CUDA kernels" if on_gpu else "CPU ops (self time; no GPU)"
    summary["iterations_profiled"] = ns.active
    summary["losses"] = state.losses
    print(
        f"top 15 by total time over {ns.active} iterations ({summary['source']}), "
        f"total {summary['total_gpu_ms']:.1f} ms in {summary['kernels']} distinct kernels:"
    )
    print(table(summary))
    print(f"fp32 SIMT GEMM share: {summary['fp32_simt_gemm_share']:.2%} "
          f"({len(summary['fp32_simt_gemm_kernels'])} kernels); "
          f"NCCL share: {summary['nccl_share']:.2%}")  # fmt: skip
    print("RESULT " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
