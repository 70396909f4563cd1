"""tp-layers overhead and the compute/communication split of a Column -> GeLU -> Row MLP.

    python benchmarks/tp_layers.py [--seq 256] [--batch 2] [--hidden 512] [--reps 15]

1. TP=1: our `ColumnParallelLinear -> GeLU -> RowParallelLinear` (no process group) against
   `nn.Linear -> GeLU -> nn.Linear` with the same weights, forward + backward (input grad
   included, as inside a model). The two are interleaved rep by rep after a warm-up and the
   medians compared, so machine noise hits both alike. Goal: ratio <= 1.05.
2. tp=2 (2 gloo processes from the parallel-state harness), without and with sequence
   parallelism: per step the median wall time, the time spent inside the collectives
   (every call into `pentatron.parallel_state.comm` and every wait on its async handles is
   timed) and the rest, which is compute. Bytes per step come from the comm ledger.

Times are medians of `--reps` steps in this run; only the ratios are meant to be compared
across machines. Runs in well under a minute with the defaults on a 2-core machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from pentatron.tp_layers import ColumnParallelLinear, RowParallelLinear

TIMED_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def build_ours(hidden: int, ffn: int, tp_group: Any = None, sequence_parallel: bool = False):
    torch.manual_seed(0)  # same master weights on every rank and for the reference
    fc1 = ColumnParallelLinear(hidden, ffn, tp_group=tp_group, sequence_parallel=sequence_parallel)
    fc2 = RowParallelLinear(
        ffn, hidden, tp_group=tp_group, input_is_parallel=True, sequence_parallel=sequence_parallel
    )
    return fc1, fc2


def step_ours(fc1, fc2, x: torch.Tensor, dy: torch.Tensor) -> None:
    """`[s(/t), b, h]` -> Column -> GeLU -> Row -> `[s(/t), b, h]`, then backward with `dy`."""
    y, _ = fc2(F.gelu(fc1(x)[0]))
    y.backward(dy)


def step_reference(lin1, lin2, x: torch.Tensor, dy: torch.Tensor) -> None:
    lin2(F.gelu(lin1(x))).backward(dy)


def zero(*modules: torch.nn.Module) -> None:
    for m in modules:
        for p in m.parameters():
            p.grad = None


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compare_tp1(args: argparse.Namespace) -> tuple[float, float]:
    """Median seconds per fwd+bwd step: (ours at TP=1, nn.Linear MLP)."""
    hidden, ffn = args.hidden, args.ffn or 4 * args.hidden
    fc1, fc2 = build_ours(hidden, ffn)
    lin1, lin2 = torch.nn.Linear(hidden, ffn), torch.nn.Linear(ffn, hidden)
    with torch.no_grad():  # identical weights: the same GEMMs, only the wrappers differ
        lin1.weight.copy_(fc1.weight), lin1.bias.copy_(fc1.bias)
        lin2.weight.copy_(fc2.weight), lin2.bias.copy_(fc2.bias)
    x = torch.randn(args.seq, args.batch, hidden, requires_grad=True)
    dy = torch.randn(args.seq, args.batch, hidden)

    def ours() -> None:
        zero(fc1, fc2)
        x.grad = None
        step_ours(fc1, fc2, x, dy)

    def reference() -> None:
        zero(lin1, lin2)
        x.grad = None
        step_reference(lin1, lin2, x, dy)

    # Same numbers, so the ratio compares like with like.
    ours()
    grad_ours = x.grad.clone()
    reference()
    torch.testing.assert_close(x.grad, grad_ours, rtol=1e-5, atol=1e-6)
    for _ in range(args.warmup):
        ours(), reference()
    t_ours, t_ref = [], []
    for rep in range(args.reps):
        # Alternate which goes first so a drift in machine speed does not favour one side.
        pair = (ours, reference) if rep % 2 == 0 else (reference, ours)
        times = {f: timed(f) for f in pair}
        t_ours.append(times[ours]), t_ref.append(times[reference])
    return statistics.median(t_ours), statistics.median(t_ref)


class CommTimer:
    """Wraps the comm module's collectives: seconds spent in calls and in waits on handles."""

    def __init__(self) -> None:
        from pentatron.parallel_state import comm

        self.comm, self.seconds, self.saved = comm, 0.0, {}

    def _timed_handle(self, handle: Any) -> Any:
        timer, wait = self, handle.wait

        def timed_wait(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return wait(*a, **kw)
            finally:
                timer.seconds += time.perf_counter() - start

        handle.wait = timed_wait
        return handle

    def __enter__(self) -> CommTimer:
        for name in TIMED_COLLECTIVES:
            original = getattr(self.comm, name)
            self.saved[name] = original

            def wrapped(*a: Any, _original: Any = original, **kw: Any) -> Any:
                start = time.perf_counter()
                try:
                    handle = _original(*a, **kw)
                finally:
                    self.seconds += time.perf_counter() - start
                return self._timed_handle(handle) if handle is not None else None

            setattr(self.comm, name, wrapped)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self.saved.items():
            setattr(self.comm, name, original)


def tp2_rank(args: argparse.Namespace, sequence_parallel: bool) -> dict[str, float]:
    """On each of 2 ranks: median step time, time in collectives, and ledger bytes per step."""
    import torch.distributed as dist

    from pentatron.parallel_state import comm

    torch.set_num_threads(args.threads)
    group, tp = dist.group.WORLD, dist.get_world_size()
    hidden, ffn = args.hidden, args.ffn or 4 * args.hidden
    fc1, fc2 = build_ours(hidden, ffn, group, sequence_parallel)
    seq = args.seq // tp if sequence_parallel else args.seq
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(seq, args.batch, hidden, requires_grad=True)
    dy = torch.randn(seq, args.batch, hidden)

    def step() -> None:
        zero(fc1, fc2)
        x.grad = None
        step_ours(fc1, fc2, x, dy)

    for _ in range(args.warmup):
        step()
    with comm.trace() as ledger:
        step()
    totals, comms = [], []
    with CommTimer() as timer:
        for _ in range(args.reps):
            dist.barrier()  # start together, so one rank's late start is not counted as comm
            before = timer.seconds
            totals.append(timed(step))
            comms.append(timer.seconds - before)
    total, comm_s = statistics.median(totals), statistics.median(comms)
    calls = {f"{op}": n for (op, _), n in ledger.by_op().items()}
    return {"total": total, "comm": comm_s, "bytes": ledger.total_bytes, "calls": str(calls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256, help="sequence length s")
    parser.add_argument("--batch", type=int, default=2, help="micro-batch size b")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size h")
    parser.add_argument("--ffn", type=int, default=0, help="MLP width (default 4h)")
    parser.add_argument("--reps", type=int, default=15, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--skip-tp2", action="store_true", help="only the TP=1 comparison")
    args = parser.parse_args()
    if args.seq % 2:
        parser.error(f"--seq={args.seq} must be even: sequence parallelism splits it over tp=2")
    torch.set_num_threads(args.threads)
    ffn = args.ffn or 4 * args.hidden
    print(
        f"MLP [s={args.seq}, b={args.batch}, h={args.hidden}] -> {ffn} -> h, fp32, CPU, "
        f"{args.threads} thread(s)/process, median of {args.reps} steps"
    )

    ours, ref = compare_tp1(args)
    ratio = ours / ref
    print(
        f"TP=1 fwd+bwd  ours {ours * 1e3:8.2f} ms   nn.Linear MLP {ref * 1e3:8.2f} ms   "
        f"ratio {ratio:.3f}  (goal <= 1.05: {'met' if ratio <= 1.05 else 'NOT met'})"
    )
    if args.skip_tp2:
        return

    from pentatron.parallel_state.testing import RankPool

    pool = RankPool(2)
    pool.start()
    try:
        for sp in (False, True):
            results = pool.run(tp2_rank, args, sp)
            total = max(r["total"] for r in results)  # a step lasts as long as its slowest rank
            comm_s = max(r["comm"] for r in results)
            label = "tp=2 + SP" if sp else "tp=2     "
            print(
                f"{label}  step {total * 1e3:8.2f} ms = compute {(total - comm_s) * 1e3:8.2f} ms "
                f"+ comm {comm_s * 1e3:8.2f} ms ({comm_s / total:5.1%})   "
                f"{results[0]['bytes'] / 2**20:.2f} MiB/rank/step {results[0]['calls']}"
            )
        print(f"(compute at tp=2 vs TP=1 ours: {(total - comm_s) / ours:.2f}x; ideal 0.5x)")
    finally:
        pool.close()


if __name__ == "__main__":
    main()
