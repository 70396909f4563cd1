"""Device check `cuda-graphs`: --enable-cuda-graph on a GPU (run_all.py runs it; not CI):

    python tools/device_checks/cuda_graphs.py          # 1 GPU: tp1 pp1
    torchrun --standalone --nproc-per-node 4 tools/device_checks/cuda_graphs.py  # tp2 pp2 vpp2

Trains the same tiny GPT (bf16, no dropout, RoPE, GQA, SwiGLU) for 8 steps through the
training app twice in this process, eagerly and with the transformer layers captured as
CUDA graphs after 3 warm-up steps, at tp = min(2, world) with sequence parallelism and,
when the world allows, pp2 with 2 virtual stages (the interleaved schedule, the capture
order's hard case) and the distributed optimizer with overlapped grad reduce and param
gather. The process group (NCCL) is created here first, from torchrun's environment or,
under plain `python`, as a world of one. Prints both loss curves, the median time per
step after capture (from the app's metrics JSONL) and `RESULT {json}`, and exits non-zero
when a graphed loss differs from the eager one by more than 1e-3 relative (bf16: cuBLAS
may pick other kernels inside a capture) or a step fails.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import _paths  # noqa: F401
import torch
import torch.distributed as dist

STEPS, WARMUP, TOL = 8, 3, 1e-3


def flags(world: int) -> list[str]:
    tp = 2 if world % 2 == 0 else 1
    pp = 2 if world % (2 * tp) == 0 else 1
    model = (
        "--num-layers 8 --hidden-size 512 --num-attention-heads 8 --group-query-attention "
        "--num-query-groups 4 --swiglu --ffn-hidden-size 1408 --position-embedding-type rope "
        "--normalization RMSNorm --disable-bias-linear --seq-length 512 "
        "--max-position-embeddings 512 --micro-batch-size 2 --mock-data --vocab-size 8192 "
        "--lr 3e-4 --lr-warmup-iters 2 --eval-iters 0 --log-interval 1 --no-progress --bf16 "
        "--hidden-dropout 0 --attention-dropout 0 --seed 3 --device cuda"
    )
    out = [
        *model.split(),
        "--train-iters",
        str(STEPS),
        "--global-batch-size",
        str(8 * max(1, world // (tp * pp))),
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        str(pp),
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
    ]
    if tp > 1:
        out.append("--sequence-parallel")
    if pp > 1:
        out += ["--num-layers-per-virtual-pipeline-stage", "2"]
    return out


def run(argv: list[str], jsonl: str) -> tuple[list[float | None], float, float | None]:
    """(losses, wall seconds, median step seconds after the capture) of one app run."""
    from pentatron.parallel_state import destroy_model_parallel
    from pentatron.pretrain.arguments import parse_args, validate_args
    from pentatron.pretrain.pretrain_gpt import pretrain

    args = validate_args(
        parse_args([*argv, "--log-jsonl", jsonl]), dist.get_world_size(), cuda=True
    )
    start = time.perf_counter()
    try:
        losses = pretrain(args).losses
    finally:
        destroy_model_parallel()
    torch.cuda.synchronize()
    return losses, time.perf_counter() - start, _step_time(jsonl)


def _step_time(jsonl: str) -> float | None:
    """Median `iteration_time_s` of the iterations after warm-up + capture (last rank)."""
    if not os.path.exists(jsonl):
        return None
    with open(jsonl) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    times = [
        r["iteration_time_s"]
        for r in recs
        if r.get("split") == "train" and r["iteration"] > WARMUP + 1 and r.get("iteration_time_s")
    ]
    return statistics.median(times) if times else None


def main() -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        print("RESULT " + json.dumps({"status": "SKIP", "note": "needs CUDA"}))
        return 0
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():  # the grid would make it, but we need the world size first
        dist.init_process_group("nccl")
    world = dist.get_world_size()
    base = flags(world)
    tmp = tempfile.mkdtemp(prefix="cuda_graphs_")
    rank = dist.get_rank()
    eager, t_eager, s_eager = run(base, os.path.join(tmp, f"eager_{rank}.jsonl"))
    graphed, t_graph, s_graph = run(
        [*base, "--enable-cuda-graph", "--cuda-graph-warmup-steps", str(WARMUP)],
        os.path.join(tmp, f"graphed_{rank}.jsonl"),
    )
    bad, worst = 0, 0.0
    if eager and eager[0] is not None:
        for i, (a, b) in enumerate(zip(eager, graphed), 1):
            rel = abs(a - b) / abs(a)
            worst = max(worst, rel)
            bad += rel > TOL
            print(f"rank {rank} step {i}: eager {a:.6f} graphed {b:.6f} rel {rel:.2e}")
        ms = lambda s: "n/a" if s is None else f"{s * 1e3:.1f} ms"  # noqa: E731
        print(f"rank {rank}: wall eager {t_eager:.1f}s, graphed {t_graph:.1f}s; per step after "
              f"capture: eager {ms(s_eager)}, graphed {ms(s_graph)}")  # fmt: skip
        result = {
            "steps": len(eager), "max_rel_diff": worst, "tolerance": TOL, "steps_differing": bad,
            "wall_eager_s": t_eager, "wall_graphed_s": t_graph,
            "step_eager_ms": None if s_eager is None else s_eager * 1e3,
            "step_graphed_ms": None if s_graph is None else s_graph * 1e3,
            "layout": {"world": world},
        }  # fmt: skip
        print("RESULT " + json.dumps(result))
    flag = torch.tensor([float(bad)], device="cuda")
    dist.all_reduce(flag)
    if rank == 0:
        print("OK" if flag.item() == 0 else f"FAIL: {int(flag.item())} steps differ")
    dist.destroy_process_group()
    return 0 if flag.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
