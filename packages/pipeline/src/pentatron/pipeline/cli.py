"""`pentatron-pipeline-timeline`: simulate a schedule, draw it, print its bubble.

    pentatron-pipeline-timeline --pp 4 --vpp 2 --num-microbatches 8 \
        --png timeline.png --chrome-trace timeline.json
    pentatron-pipeline-timeline --pp 4 --num-microbatches 8 --schedule zb-h1 --png zb.png

`--schedule zb-h1` draws the zero-bubble table (B: input gradient, W: weight gradient; B and
W cost 1 each unless given); the app runs it with `--pipeline-schedule zb-h1`. `--schedule
zbv` draws ZBV's table (two chunks per rank in a V; costs are a chunk's); no executor yet.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from .bubble import bubble_report, ideal_bubble_fraction
from .config import PipelineConfig, check_schedule
from .render import render_png
from .timeline import simulate, to_chrome_trace
from .zero_bubble import zb_h1_bubble_fraction


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="pentatron-pipeline-timeline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--pp", type=int, required=True, help="pipeline ranks p")
    ap.add_argument("--vpp", type=int, default=None, help="chunks per rank v (interleaved)")
    ap.add_argument("--num-microbatches", "-m", type=int, required=True)
    ap.add_argument("--microbatch-group-size-per-vp-stage", type=int, default=None)
    ap.add_argument("--forward-cost", type=float, default=1.0)
    ap.add_argument(
        "--schedule",
        choices=["1f1b", "interleaved", "zb-h1", "zbv"],
        default=None,
        help="default: interleaved with --vpp, else 1f1b",
    )
    ap.add_argument("--backward-cost", type=float, default=None, help="default 2 (zb-h1, zbv: 1)")
    ap.add_argument("--weight-cost", type=float, default=1.0, help="zb-h1's and zbv's W")
    ap.add_argument("--p2p-cost", type=float, default=0.0)
    ap.add_argument("--forward-only", action="store_true")
    ap.add_argument("--png", default=None, help="write the Gantt chart here")
    ap.add_argument("--chrome-trace", default=None, help="write a chrome://tracing JSON here")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = PipelineConfig(
        hidden_size=1,
        batch_p2p_comm=False,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
    )
    check_schedule(config, pp=args.pp, vpp=args.vpp, num_microbatches=args.num_microbatches)
    zb = args.schedule in ("zb-h1", "zbv")
    backward = args.backward_cost if args.backward_cost is not None else (1.0 if zb else 2.0)
    events = simulate(
        args.pp,
        args.num_microbatches,
        args.vpp,
        args.microbatch_group_size_per_vp_stage,
        args.forward_cost,
        backward,
        args.p2p_cost,
        args.forward_only,
        schedule=args.schedule,
        weight_cost=args.weight_cost,
    )
    report = bubble_report(events)
    name = f"p={args.pp}" + (f", v={args.vpp}" if args.vpp else "") + f", m={args.num_microbatches}"
    print(f"{name}: {report.summary()}")
    if args.schedule == "zbv":
        closed = (args.pp - 1) / (6 * args.num_microbatches)
        print(f"start-up only, equal costs: (p-1)/(6m) = {closed:.4f}")
    elif zb:
        closed = zb_h1_bubble_fraction(
            args.pp, args.num_microbatches, args.forward_cost, backward, args.weight_cost
        )
        print(f"closed form (p-1)(F+B-W)/(m(F+B+W)) = {closed:.4f}")
    else:
        closed = ideal_bubble_fraction(args.pp, args.num_microbatches, args.vpp)
        print(f"closed form (p-1)/(v*m) = {closed:.4f}")
    if args.png:
        print(f"wrote {render_png(events, args.png, title=name)}")
    if args.chrome_trace:
        with open(args.chrome_trace, "w") as f:
            json.dump(to_chrome_trace(events), f)
        print(f"wrote {args.chrome_trace}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
