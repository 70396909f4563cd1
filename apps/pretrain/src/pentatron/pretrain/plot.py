"""`pentatron-plot`: loss and throughput curves from the JSONL files `TrainingLogger` writes.

    pentatron-plot run/metrics.jsonl [other_run/metrics.jsonl ...] [--out loss.png]
                   [--x iteration|tokens]

draws, per file, the training lm loss (and the validation loss where the file has it) on
the top axes and tokens/s below, to one PNG (matplotlib's Agg backend, no display needed).
A resumed run appends to its file; if it restarted from an earlier checkpoint, the last
record written for an iteration wins.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

INSTALL_HINT = (
    "pentatron-plot needs matplotlib: pip install matplotlib "
    "(or pip install 'pentatron-pretrain[plot]')"
)
X_KEYS = {"iteration": "iteration", "tokens": "consumed_tokens"}


def read_records(path: str | Path) -> dict[str, list[dict[str, Any]]]:
    """`{"train": [...], "valid": [...]}` sorted by iteration, last record per iteration kept.

    Unparseable lines (a run killed mid-write) are skipped.
    """
    by_split: dict[str, dict[int, dict[str, Any]]] = {}
    with open(path, encoding="utf-8") as file:
        for line in file:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(record, dict) or "iteration" not in record:
                continue
            by_split.setdefault(record.get("split", "train"), {})[record["iteration"]] = record
    return {split: [recs[k] for k in sorted(recs)] for split, recs in by_split.items()}


def _series(records: list[dict[str, Any]], x_key: str, y_key: str) -> tuple[list, list]:
    points = [
        (r[x_key], r[y_key])
        for r in records
        if r.get(x_key) is not None and r.get(y_key) is not None
    ]
    return [p[0] for p in points], [p[1] for p in points]


def plot(paths: Sequence[str | Path], out: str | Path, x: str = "iteration") -> Path:
    """Write the loss / throughput figure of `paths` to `out`; returns `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key = X_KEYS[x]
    fig, (loss_ax, speed_ax) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    drew_any = False
    for path in paths:
        prefix = f"{path} " if len(paths) > 1 else ""
        splits = read_records(path)
        train = splits.get("train", [])
        xs, ys = _series(train, x_key, "lm_loss")
        if xs:
            (line,) = loss_ax.plot(xs, ys, label=f"{prefix}train")
            drew_any = True
            color = line.get_color()
        else:
            color = None
        for split, records in splits.items():
            if split == "train":
                continue
            xs, ys = _series(records, x_key, "lm_loss")
            if xs:
                loss_ax.plot(xs, ys, "o--", color=color, label=f"{prefix}{split}")
                drew_any = True
        xs, ys = _series(train, x_key, "tokens_per_s")
        if xs:
            speed_ax.plot(xs, ys, color=color, label=f"{prefix}tokens/s")
    if not drew_any:
        plt.close(fig)
        raise ValueError(f"no lm loss with a {x_key!r} value in {', '.join(map(str, paths))}")
    loss_ax.set_ylabel("lm loss")
    loss_ax.legend()
    loss_ax.grid(alpha=0.3)
    speed_ax.set_ylabel("tokens/s")
    speed_ax.set_xlabel("tokens" if x == "tokens" else "iteration")
    speed_ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pentatron-plot", description="Plot lm loss and tokens/s from metrics JSONL files."
    )
    parser.add_argument("jsonl", nargs="+", help="metrics JSONL file(s) written by a run")
    parser.add_argument("--out", default="loss.png", help="PNG to write (default: loss.png)")
    parser.add_argument("--x", choices=sorted(X_KEYS), default="iteration", help="x axis")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 1
    try:
        out = plot(args.jsonl, args.out, args.x)
    except (OSError, ValueError) as error:
        print(f"pentatron-plot: {error}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
