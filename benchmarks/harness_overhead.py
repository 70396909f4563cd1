"""Harness overhead: 100 trivial 4-rank calls through the persistent pool vs 100 local calls.

    python benchmarks/harness_overhead.py [--calls 100] [--world 4]

Prints per-call times and their ratio, measured in this process against a local baseline
(these machines are noisy, so absolute seconds mean little). Goal: a 4-rank call well under
50 ms once the pool is up; the one-off spawn cost is printed separately.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from pentatron.parallel_state.testing import RankPool


def trivial() -> float:
    """One tiny all_reduce, so a call really crosses every rank."""
    x = torch.ones(1)
    if dist.is_initialized():
        dist.all_reduce(x)
    return x.item()


def timed(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--world", type=int, default=4)
    args = parser.parse_args()

    local = timed(trivial, args.calls)
    pool = RankPool(args.world)
    start = time.perf_counter()
    pool.start()
    results = pool.run(trivial)  # first call: workers import torch and join the group
    spawn = time.perf_counter() - start
    assert results == [float(args.world)] * args.world, results
    remote = timed(lambda: pool.run(trivial), args.calls)
    pool.close()

    print(f"pool spawn + first call ({args.world} ranks): {spawn * 1e3:9.1f} ms (once per session)")
    print(f"local call:                        {local * 1e3:9.3f} ms")
    print(f"{args.world}-rank pool call:                 {remote * 1e3:9.3f} ms")
    print(f"ratio pool/local:                  {remote / local:9.0f}x")
    print(f"goal < 50 ms per {args.world}-rank call:       {'met' if remote < 0.05 else 'NOT met'}")


if __name__ == "__main__":
    main()
