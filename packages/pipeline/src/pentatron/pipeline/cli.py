"""`pentatron-pipeline-timeline`: simulate a schedule, draw it, print its bubble.

    pentatron-pipeline-timeline --pp 4 --vpp 2 --num-microbatches 8 \
        --png timeline.png --chrome-trace timeline.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from .bubble import bubble_report, ideal_bubble_fraction
from .config import PipelineConfig, check_schedule
from .render import render_png
from .timeline import simulate, to_chrome_trace


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
    ap.add_argument("--backward-cost", type=float, default=2.0)
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
    events = simulate(
        args.pp,
        args.num_microbatches,
        args.vpp,
        args.microbatch_group_size_per_vp_stage,
        args.forward_cost,
        args.backward_cost,
        args.p2p_cost,
        args.forward_only,
    )
    report = bubble_report(events)
    name = f"p={args.pp}" + (f", v={args.vpp}" if args.vpp else "") + f", m={args.num_microbatches}"
    print(f"{name}: {report.summary()}")
    print(
        f"closed form (p-1)/(v*m) = "
        f"{ideal_bubble_fraction(args.pp, args.num_microbatches, args.vpp):.4f}"
    )
    if args.png:
        print(f"wrote {render_png(events, args.png, title=name)}")
    if args.chrome_trace:
        with open(args.chrome_trace, "w") as f:
            json.dump(to_chrome_trace(events), f)
        print(f"wrote {args.chrome_trace}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
