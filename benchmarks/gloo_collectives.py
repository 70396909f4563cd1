"""gloo collectives: comm's all-to-all algorithms vs torch's own, CPU time per call.

    python benchmarks/gloo_collectives.py [--calls 200] [--worlds 2 8] [--sizes 64 65536]

Each rank issues `--calls` of each collective, torch's and comm's interleaved in blocks,
and reports the median process CPU time (every thread: gloo's transport threads do most of
the work) and wall time per call; the table prints comm/torch ratios from this run (goal:
< 1 for each op at every world size). The ranks share the machine's cores, as in the test
suite, so wall times include waiting for descheduled peers; CPU time is the cost.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from pentatron.parallel_state import comm
from pentatron.parallel_state.testing import PoolSet

# torch's tensor-form collectives under whichever name this torch has (comm's shims)
_ALL_GATHER, _REDUCE_SCATTER = comm._ALL_GATHER_SINGLE, comm._REDUCE_SCATTER_SINGLE


def _ops(numel: int) -> dict[str, tuple]:
    n = dist.get_world_size()
    x, big, out = torch.ones(numel), torch.ones(numel * n), torch.empty(numel * n)
    return {
        "all_reduce": (lambda: dist.all_reduce(x), lambda: comm.all_reduce(x)),
        "reduce_scatter": (
            lambda: _REDUCE_SCATTER(x, big),
            lambda: comm.reduce_scatter_tensor(x, big),
        ),
        "all_gather": (lambda: _ALL_GATHER(out, x), lambda: comm.all_gather_into_tensor(out, x)),
    }


def _measure(fn, calls: int) -> tuple[float, float]:
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls


def bench(calls: int, numel: int, blocks: int = 5) -> dict[str, dict[str, float]]:
    """On every rank: per op, the medians over `blocks` alternating blocks of each path."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's old collective names
    result = {}
    for name, (theirs, ours) in _ops(numel).items():
        samples: dict[str, list[tuple[float, float]]] = {"torch": [], "comm": []}
        for _ in range(blocks):
            samples["torch"].append(_measure(theirs, calls // blocks))
            samples["comm"].append(_measure(ours, calls // blocks))
        result[name] = {
            f"{path}_{kind}": statistics.median(s[i] for s in runs)
            for path, runs in samples.items()
            for i, kind in enumerate(("wall", "cpu"))
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 65536])
    args = parser.parse_args()
    pools = PoolSet()
    print(f"{'world':>5} {'elements':>9} {'op':<15} {'torch cpu ms':>12} {'comm cpu ms':>11}")
    try:
        for world in args.worlds:
            for numel in args.sizes:
                ranks = pools.run(world, bench, args.calls, numel)
                for op in ranks[0]:
                    theirs = statistics.mean(r[op]["torch_cpu"] for r in ranks) * 1e3
                    ours = statistics.mean(r[op]["comm_cpu"] for r in ranks) * 1e3
                    ratio = ours / theirs
                    line = f"{world:>5} {numel:>9} {op:<15} {theirs:>12.3f} {ours:>11.3f}"
                    print(
                        f"{line}  ratio {ratio:.2f} {'(goal < 1: met)' if ratio < 1 else 'NOT met'}"
                    )
    finally:
        pools.close()


if __name__ == "__main__":
    main()
