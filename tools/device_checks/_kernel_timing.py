"""What the attention device-check scripts share (`attention_variants.py`, `cp_blocks.py`):
their command line, and timing a call with its SDPA kernel family and peak memory.

- `parse_device(doc)`: `--device cuda|cpu` and `--tiny`; bf16 on CUDA, fp32 on the CPU.
  None (after printing a SKIP `RESULT`) where CUDA is asked for and there is none;
- `measure(device, call)`: ms per call (median of `reps` after `warmup` calls; CUDA events
  on a GPU), and on CUDA the SDPA kernel family of one profiled call
  (`_kernels.sdpa_backend`) and the peak memory of the timed calls over what was allocated
  before them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from _kernels import device_kernels, sdpa_backend


def parse_device(doc: str) -> tuple[torch.device, torch.dtype, bool] | None:
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="small shapes (the CPU smoke)")
    opts = p.parse_args()
    if opts.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        print("RESULT " + json.dumps({"status": "SKIP", "note": "needs CUDA"}))
        return None
    device = torch.device(opts.device)
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32, opts.tiny


def timed_ms(device: torch.device, call: Callable[[], object], reps: int, warmup: int) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(
    device: torch.device, call: Callable[[], object], reps: int = 10, warmup: int = 3
) -> dict:
    """{"ms"} and, on CUDA, {"backend", "peak_mib"} of `call`."""
    res: dict = {}
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        res["backend"] = sdpa_backend(sorted(device_kernels(prof)))
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    res["ms"] = timed_ms(device, call, reps, warmup)
    if device.type == "cuda":
        res["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return res
