"""Scaling of the README quickstart model over CPU world sizes 1, 2, 4, 8 (torchrun).

    python benchmarks/scaling.py [--iters 6]

The model and batch of `examples/configs/quickstart-cpu.yaml` (4 layers, hidden 128, GQA,
SwiGLU, RoPE; global batch 32 x seq 128 = 4096 tokens per step) on mock data, at
1: tp1 pp1 dp1, 2: dp2, 4: tp2 dp2 (SP, ZeRO-1), 8: the quickstart layout tp2 pp2 (vpp 2)
dp2. The work per step is the same at every size, so `ratio` = step time / step time at
world size 1 is the cost per unit of work; on a 2-core machine the ideal is
1 / min(world, 2) and the rest is communication and over-subscription. The step time is
the median of the app's own "elapsed time per iteration" over the logged iterations
after the first (which includes warm-up), peak memory its "max memory" (max RSS of the logging rank on CPU).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "configs" / "quickstart-cpu.yaml"
LAYOUTS = {
    1: {},
    2: {},
    4: {"tensor-model-parallel-size": 2, "sequence-parallel": "true"},
    8: None,  # the quickstart file as is
}
LAYOUT_KEYS = ("tensor-model-parallel-size", "pipeline-model-parallel-size",
               "num-layers-per-virtual-pipeline-stage", "sequence-parallel")  # fmt: skip
RUN_KEYS = ("save", "load", "save-interval", "tensorboard-dir", "train-iters", "log-interval",
            "eval-interval", "eval-iters", "lr-warmup-iters")  # fmt: skip


def config_for(world: int, iters: int, out: Path) -> Path:
    """The quickstart config with this world size's layout, `iters` steps, no save/eval."""
    layout = LAYOUTS[world]
    drop = RUN_KEYS + (LAYOUT_KEYS if layout is not None else ())
    lines = [ln for ln in CONFIG.read_text().splitlines() if ln.split(":")[0].strip() not in drop]
    extra: dict[str, Any] = dict(layout or {})
    extra.update(
        {
            "train-iters": iters,
            "log-interval": 1,
            "eval-interval": 10**6,
            "eval-iters": 0,
            "lr-warmup-iters": 0,
        }
    )
    lines += [f"{k}: {v}" for k, v in extra.items()]
    path = out / f"ws{world}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_world(world: int, iters: int, tmp: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", "-m", "pentatron.pretrain",
           "--config", str(config_for(world, iters, tmp)), "--mock-data"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp)
    times = re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", proc.stdout)
    mems = re.findall(r"max memory \(MB\): ([0-9.]+)", proc.stdout)
    if proc.returncode or not times:
        tail = (proc.stdout + "\n" + proc.stderr).strip().splitlines()
        errors = [
            ln
            for ln in tail
            if re.search(r"(Error|Exception|error):", ln) and "ChildFailedError" not in ln
        ]
        error = errors[0] if errors else (tail[-1] if tail else "?")
        return {"world": world, "error": error.strip()[:120]}
    steady = [float(t) / 1e3 for t in times[1:]] or [float(times[0]) / 1e3]
    return {"world": world, "step_s": statistics.median(steady),
            "peak_mib": float(mems[-1]) if mems else None}  # fmt: skip


def measure(iters: int = 6) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_world(w, iters, Path(tmp)) for w in LAYOUTS]
    base = results[0].get("step_s")
    for r in results:
        r["ratio"] = r["step_s"] / base if base and "step_s" in r else None
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=6)
    args = parser.parse_args()
    for r in measure(args.iters):
        if "error" in r:
            print(f"world {r['world']}: not measured: {r['error']}")
        else:
            print(f"world {r['world']}: step {r['step_s'] * 1e3:8.1f} ms  peak {r['peak_mib']} MiB"
                  f"  ratio vs world 1 per unit of work {r['ratio']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
