"""Throughput and memory figures of a logged interval (closed forms, no state)."""

from __future__ import annotations

import os
import resource
import sys

import torch


def tflops_per_device(
    flops_per_iteration: float, iteration_time_s: float, world_size: int
) -> float:
    """Model TFLOP/s per device: `flops_per_iteration / iteration_time / world_size / 1e12`.

    `flops_per_iteration` is the model FLOPs of one step on the whole global batch
    (`pentatron.models.counting.num_floating_point_operations(config, s, V, global_batch)`),
    so dividing by the world size gives what one device did (Megatron's "TFLOP/s/GPU").
    """
    return flops_per_iteration / iteration_time_s / world_size / 1e12


def tokens_per_second(tokens_per_iteration: int, iteration_time_s: float) -> float:
    """Tokens of the global batch processed per second, all devices together."""
    return tokens_per_iteration / iteration_time_s


def peak_memory_bytes() -> int:
    """`torch.cuda.max_memory_allocated()` when CUDA is in use, else this process's max RSS.

    CUDA is only asked when it is already initialised, so a CPU run never creates a context.
    `ru_maxrss` is in KiB on Linux and in bytes on macOS.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def memory_scalars() -> dict[str, float]:
    """Megatron's --log-memory-to-tensorboard scalars.

    CUDA (when initialised): `torch.cuda.memory_stats()`'s reserved, allocated and peak
    allocated bytes and the live allocation count, under Megatron's tags. CPU has no caching
    allocator: `mem-allocated-bytes` is the process's current resident set size (Linux) and
    `mem-max-allocated-bytes` its peak.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        return {
            "mem-reserved-bytes": float(stats["reserved_bytes.all.current"]),
            "mem-allocated-bytes": float(stats["allocated_bytes.all.current"]),
            "mem-max-allocated-bytes": float(stats["allocated_bytes.all.peak"]),
            "mem-allocated-count": float(stats["allocation.all.current"]),
        }
    out = {"mem-max-allocated-bytes": float(peak_memory_bytes())}
    try:
        with open("/proc/self/statm", encoding="ascii") as f:  # pages: size resident ...
            out["mem-allocated-bytes"] = float(
                int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            )
    except OSError:  # no /proc (macOS): the peak only
        pass
    return out


def format_eta(seconds: float) -> str:
    """`H:MM:SS` (days as `Nd H:MM:SS`), for the console line and the progress bar."""
    seconds = max(0, round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    clock = f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{days}d {clock}" if days else clock
