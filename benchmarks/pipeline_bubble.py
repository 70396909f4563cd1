"""Pipeline bubble: the simulator and measured CPU runs against the closed forms:
(p-1)/(v*m) for 1F1B and interleaving, (p-1)/(3m) for ZB-H1, (p-1)/(6m) for ZBV (start-up
only).

    python benchmarks/pipeline_bubble.py

1. `pentatron.pipeline.simulate` (logical time, free p2p; backward = 2 x forward, or for
   ZB-H1 and ZBV B = W = forward) for a few (p, v, m): its bubble fraction (idle / busy)
   over the closed form; exact.
2. Measured: the real 1F1B, interleaved, ZB-H1 and ZBV schedules on 2 and 4 gloo processes
   (one thread each), every rank the same cost (`LAYERS` tp-layers ColumnParallelLinear(h, h)
   + tanh on [s, b, h], whose weight gradients ZB-H1 and ZBV defer; split over the chunks
   of interleaving and of ZBV's V);
   the compute spans come from the schedule's own `Timeline`, the bubble from
   `bubble_report` over both ranks' events. p2p time and the machine's noise count as
   idle, so the ratio is >= 1 and only its size is machine-dependent. Median of `REPS` steps.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

S, B, H, LAYERS, REPS = 64, 4, 256, 4, 3
SIMULATED = ((2, 1, 4), (4, 1, 8), (2, 2, 4), (4, 2, 8))  # (p, v, m)
SIMULATED_ZB = ((2, 4), (4, 8))  # (p, m)
# (p, vpp, m, schedule)
MEASURED = (
    (2, None, 8, "1f1b"),
    (2, 2, 8, "interleaved"),
    (2, None, 8, "zb-h1"),
    (2, None, 8, "zbv"),
    (4, None, 8, "1f1b"),
    (4, 2, 8, "interleaved"),
    (4, None, 8, "zb-h1"),
    (4, None, 8, "zbv"),
)


def simulated_rows() -> list[dict[str, Any]]:
    from pentatron.pipeline import (
        bubble_report,
        ideal_bubble_fraction,
        simulate,
        zb_h1_bubble_fraction,
    )

    rows = []
    for p, v, m in SIMULATED:
        got = bubble_report(simulate(p, m, v if v > 1 else None)).bubble_fraction
        rows.append(
            {"name": f"bubble simulator p={p} v={v} m={m}", "measured": got,
             "theory": ideal_bubble_fraction(p, m, v)}
        )  # fmt: skip
    for p, m in SIMULATED_ZB:
        events = simulate(p, m, None, schedule="zb-h1", backward_cost=1.0, weight_cost=1.0)
        rows.append(
            {"name": f"bubble simulator ZB-H1 p={p} m={m}",
             "measured": bubble_report(events).bubble_fraction,
             "theory": zb_h1_bubble_fraction(p, m)}
        )  # fmt: skip
        events = simulate(p, m, None, schedule="zbv", backward_cost=1.0, weight_cost=1.0)
        rows.append(
            {"name": f"bubble simulator ZBV p={p} m={m}",
             "measured": bubble_report(events).bubble_fraction, "theory": (p - 1) / (6 * m)}
        )  # fmt: skip
    return rows


class _Stage(torch.nn.Module):
    def __init__(self, first: bool, layers: int = LAYERS) -> None:
        super().__init__()
        from pentatron.tp_layers import ColumnParallelLinear

        torch.manual_seed(0)  # equal cost and equal numbers on every stage
        self.fcs = torch.nn.ModuleList(ColumnParallelLinear(H, H) for _ in range(layers))
        self.first, self.input_tensor = first, None

    def set_input_tensor(self, tensors: list) -> None:
        self.input_tensor = tensors[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.first else self.input_tensor
        for fc in self.fcs:
            h = torch.tanh(fc(h)[0])
        return h


def _forward_step(it: Any, model: _Stage) -> tuple[torch.Tensor, Any]:
    out = model(next(it))
    return out, lambda y: (y.pow(2).mean(), y.detach().pow(2).mean())


def measured_rank(vpp: int | None, m: int, schedule: str) -> list[list[tuple]]:
    """Per rep: this rank's compute events as (rank, start, end, kind, mb, chunk), absolute."""
    from pentatron.parallel_state import (
        ParallelConfig,
        destroy_model_parallel,
        initialize_model_parallel,
    )
    from pentatron.pipeline import PipelineConfig, Timeline, get_forward_backward_func
    from pentatron.tp_layers import WeightGradStore

    torch.set_num_threads(1)
    p, v = dist.get_world_size(), 2 if schedule == "zbv" else vpp or 1
    grid = initialize_model_parallel(ParallelConfig(pp=p, vpp=vpp))
    try:
        rank = grid.rank("pp")
        chunks = [_Stage(rank == 0 and c == 0, LAYERS // v) for c in range(v)]
        data = [torch.randn(S, B, H) for _ in range(m)]
        func = get_forward_backward_func(p, vpp, schedule)
        store = WeightGradStore() if schedule in ("zb-h1", "zbv") else None
        reps = []
        for _ in range(REPS + 1):  # the first is a warm-up
            dist.barrier()
            origin = time.monotonic()  # a clock shared by the processes of this machine
            timeline = Timeline(rank=rank, clock=time.monotonic)
            func(
                forward_step_func=_forward_step,
                data_iterator=[iter(data) for _ in range(v)],
                model=chunks if v > 1 else chunks[0],
                num_microbatches=m, seq_length=S, micro_batch_size=B,
                config=PipelineConfig(hidden_size=H, weight_grad_store=store), grid=grid,
                timeline=timeline,
            )  # fmt: skip
            reps.append(
                [(e.rank, e.start + origin, e.end + origin, e.kind, e.microbatch, e.chunk)
                 for e in timeline.events]
            )  # fmt: skip
        return reps[1:]
    finally:
        destroy_model_parallel(grid)


def measured_rows(pools: Any, png_dir: str | None = None) -> list[dict[str, Any]]:
    """One row per MEASURED case; with `png_dir`, also each case's median step drawn there
    (`pentatron.pipeline.render`: F blue, B green, W orange, idle white)."""
    from pentatron.pipeline import (
        Event,
        bubble_report,
        ideal_bubble_fraction,
        zb_h1_bubble_fraction,
    )

    rows = []
    for p, vpp, m, schedule in MEASURED:
        per_rank = pools.run(p, measured_rank, vpp, m, schedule)
        fractions, steps = [], []
        for rep in range(REPS):
            events = [Event(*e) for r in per_rank for e in r[rep]]
            fractions.append(bubble_report(events).bubble_fraction)
            steps.append(events)
        v = 2 if schedule == "zbv" else vpp or 1
        if png_dir is not None:
            median = steps[fractions.index(statistics.median_low(fractions))]
            _draw(median, f"{png_dir}/measured_{schedule}_p{p}_m{m}.png", f"{schedule} p={p} m={m}")
        theory = {
            "zb-h1": zb_h1_bubble_fraction(p, m),
            "zbv": (p - 1) / (6 * m),  # the V's start-up, equal F, B, W (its table's bubble)
        }.get(schedule, ideal_bubble_fraction(p, m, v))
        rows.append(
            {"name": f"bubble measured ({p} CPU procs) {schedule} p={p} v={v} m={m}",
             "measured": statistics.median(fractions), "theory": theory}
        )  # fmt: skip
    return rows


def _draw(events: list[Any], path: str, title: str) -> None:
    """The step's events from time 0, in milliseconds, as a PNG."""
    import dataclasses

    from pentatron.pipeline.render import render_png

    t0 = min(e.start for e in events)
    shifted = [
        dataclasses.replace(e, start=(e.start - t0) * 1e3, end=(e.end - t0) * 1e3) for e in events
    ]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    render_png(shifted, path, title=f"{title} (measured, ms)")


def main() -> None:
    import argparse

    from pentatron.parallel_state.testing import PoolSet

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--png-dir", default=None, help="also draw each measured step here")
    args = parser.parse_args()
    pools = PoolSet()
    try:
        rows = simulated_rows() + measured_rows(pools, args.png_dir)
    finally:
        pools.close()
    for row in rows:
        ratio = row["measured"] / row["theory"]
        print(f"{row['name']:50s} {row['measured']:.4f} / {row['theory']:.4f} = {ratio:.2f}")


if __name__ == "__main__":
    main()
