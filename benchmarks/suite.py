"""The performance suite: one command, one table, every line a ratio measured in this run.

    python benchmarks/suite.py [--quick]

Parts (each also runnable alone; the command is printed next to its lines):
1. framework overhead, medians of interleaved steps in this process (goal: ratio <= 1.0,
   1.05, 1.10): our GPT step vs transformers' Llama (same weights via `from_hf`, losses
   asserted equal first; with glibc's default heap and, in a child process, with the heap
   kept, see models.py), TP=1 tp-layers MLP vs nn.Linear, DistributedOptimizer vs AdamW;
2. communication volume per step and rank from the comm ledger over closed forms written
   in `comm_volume.py` (TP, SP, PP with vpp, DDP, ZeRO-1; EP when MoE is there): exactly 1;
3. pipeline bubble: the simulator (exactly 1) and a measured 2-process run vs (p-1)/(v*m);
4. scaling of the quickstart model at world sizes 1, 2, 4, 8 (torchrun), step time per
   unit of work vs world size 1, and peak memory.
Timings are medians in one process, so machine noise hits both sides of a ratio alike;
only the ratios are meant to be compared across machines. About 100 s on an idle 2-core
machine (79-98 s recorded in docs/performance.md); longer when the cores are shared.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import comm_volume
import models as models_bench
import optim as optim_bench
import pipeline_bubble
import scaling
import tp_layers as tp_bench

# Small enough for 2 cores; the standalone scripts' defaults are larger.
GPT_ARGS = dict(layers=2, hidden=256, heads=8, groups=4, ffn=688, vocab=4096, batch=2, seq=128,
                reps=9, warmup=2, threads=1)  # fmt: skip
MLP_ARGS = dict(seq=256, batch=2, hidden=512, ffn=0, reps=15, warmup=3, threads=1)
OPT_ARGS = dict(hidden=512, layers=4, reps=15, warmup=3)


def overhead_rows(quick: bool) -> list[dict[str, Any]]:
    scale = dict(reps=5) if quick else {}
    gpt = models_bench.compare(argparse.Namespace(**{**GPT_ARGS, **scale}))
    gpt_kept = models_bench.compare_kept_heap(argparse.Namespace(**{**GPT_ARGS, **scale}))
    mlp = tp_bench.compare_tp1(argparse.Namespace(**{**MLP_ARGS, **scale}))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        opt = optim_bench.optimizer_ratio(argparse.Namespace(**{**OPT_ARGS, **scale}), 1.0)
    finally:
        dist.destroy_process_group()
    g = GPT_ARGS
    return [
        {"name": f"GPT step ours / transformers Llama (L{g['layers']} h{g['hidden']} "
                 f"s{g['seq']} b{g['batch']}; loss {gpt['loss_ours']:.4f} = "
                 f"{gpt['loss_theirs']:.4f})",
         "measured": gpt["ours"], "theory": gpt["theirs"], "unit": "s", "goal": "<= 1.0",
         "cmd": "python benchmarks/models.py --layers 2 --seq 128 --batch 2 --reps 9 --threads 1"},
        {"name": "the same, glibc heap never trimmed (child process, MALLOC_*_THRESHOLD_ fixed)",
         "measured": gpt_kept["ours"], "theory": gpt_kept["theirs"], "unit": "s",
         "goal": "<= 1.0",
         "cmd": "python benchmarks/models.py --layers 2 --seq 128 --batch 2 --reps 9 "
                "--threads 1 --heap kept"},
        {"name": "TP=1 MLP fwd+bwd tp-layers / nn.Linear [256, 2, 512]",
         "measured": mlp[0], "theory": mlp[1], "unit": "s", "goal": "<= 1.05",
         "cmd": "python benchmarks/tp_layers.py --skip-tp2"},
        {"name": "DistributedOptimizer.step / clip_grad_norm_ + AdamW.step (8.4M params)",
         "measured": opt[0], "theory": opt[1], "unit": "s", "goal": "<= 1.10",
         "cmd": "python benchmarks/optim.py --skip-ddp"},
    ]  # fmt: skip


def comm_rows(pools: Any) -> list[dict[str, Any]]:
    rows = comm_volume.measure(pools)
    for r in rows:
        r.update(unit="elements", goal="= 1.00", cmd="python benchmarks/comm_volume.py")
    return rows


def bubble_rows(pools: Any) -> list[dict[str, Any]]:
    rows = pipeline_bubble.simulated_rows() + pipeline_bubble.measured_rows(pools)
    for r in rows:
        sim = "simulator" in r["name"]
        r.update(unit="idle/busy", goal="= 1.00" if sim else ">= 1 (p2p, noise)",
                 cmd="python benchmarks/pipeline_bubble.py")  # fmt: skip
    return rows


def scaling_rows(iters: int) -> list[dict[str, Any]]:
    rows = []
    for r in scaling.measure(iters):
        name = f"quickstart model, world {r['world']}: step time / world 1"
        row = {"name": name, "unit": "s", "goal": f"ideal {1 / min(r['world'], 2):.2f} on 2 cores",
               "cmd": "python benchmarks/scaling.py"}  # fmt: skip
        if "error" in r:
            row.update(measured=None, theory=None, note=f"not measured: {r['error']}")
        else:
            row.update(measured=r["step_s"], theory=rows[0]["measured"] if rows else r["step_s"])
            peak = r.get("peak_mib")  # None when the run logged no "max memory" line
            row["name"] += " (peak not logged)" if peak is None else f" (peak {peak:.0f} MiB)"
        rows.append(row)
    return rows


def fmt(row: dict[str, Any]) -> str:
    m, t = row.get("measured"), row.get("theory")
    if m is None or not t:
        return f"| {row['name']} | {row.get('note', 'not measured')} | | | | `{row['cmd']}` |"
    if row.get("unit") == "s":
        num = f"{m * 1e3:.2f} ms / {t * 1e3:.2f} ms"
    elif isinstance(m, float):
        num = f"{m:.4f} / {t:.4f}"
    else:
        num = f"{m} / {t}"
    return f"| {row['name']} | {num} | **{m / t:.2f}** | {row['goal']} | `{row['cmd']}` |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument("--skip-scaling", action="store_true", help="no torchrun part")
    parser.add_argument("--scaling-iters", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from pentatron.parallel_state.testing import PoolSet

    start = time.perf_counter()
    sections = [("framework overhead", lambda: overhead_rows(args.quick))]
    pools = PoolSet()
    sections += [("communication volume per step and rank", lambda: comm_rows(pools)),
                 ("pipeline bubble", lambda: bubble_rows(pools))]  # fmt: skip
    if not args.skip_scaling:
        sections.append(("scaling (CPU, torchrun)", lambda: scaling_rows(args.scaling_iters)))
    print(f"Pentatron performance suite: torch {torch.__version__}, CPU, 1 thread per process")
    print("| line | measured / baseline | ratio | goal | command |")
    print("|---|---|---|---|---|")
    try:
        for title, part in sections:
            print(f"| **{title}** | | | | |", flush=True)
            for row in part():
                print(fmt(row), flush=True)
    finally:
        pools.close()
    print(f"suite wall time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
