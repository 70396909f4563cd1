"""GPU check of --enable-cuda-graph (run where CUDA exists; not part of CI):

    python tools/device_checks/cuda_graphs.py          # 1 GPU: tp1 pp1
    torchrun --standalone --nproc-per-node 4 tools/device_checks/cuda_graphs.py  # tp2 pp2 vpp2

Trains the same tiny GPT (bf16, no dropout, RoPE, GQA, SwiGLU) for 8 steps through the
training app twice, eagerly and with the transformer layers captured as CUDA graphs after
3 warm-up steps, at tp = min(2, world) with sequence parallelism and, when the world
allows, pp2 with 2 virtual stages (the interleaved schedule, the capture order's hard
case) and the distributed optimizer with overlapped grad reduce and param gather.
Prints both loss curves, the time per step after capture, and exits non-zero when a
graphed loss differs from the eager one by more than 1e-3 relative (bf16: cuBLAS may pick
other kernels inside a capture) or a step fails.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

STEPS, TOL = 8, 1e-3


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


def run(argv: list[str]) -> tuple[list[float | None], float]:
    from pentatron.parallel_state import destroy_model_parallel
    from pentatron.pretrain.arguments import parse_args, validate_args
    from pentatron.pretrain.pretrain_gpt import pretrain

    args = validate_args(parse_args(argv), dist.get_world_size(), cuda=True)
    start = time.perf_counter()
    try:
        losses = pretrain(args).losses
    finally:
        destroy_model_parallel()
    torch.cuda.synchronize()
    return losses, time.perf_counter() - start


def main() -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    world = int(os.environ["WORLD_SIZE"])
    base = flags(world)
    eager, t_eager = run(base)
    graphed, t_graph = run([*base, "--enable-cuda-graph", "--cuda-graph-warmup-steps", "3"])
    bad = 0
    if eager and eager[0] is not None:
        for i, (a, b) in enumerate(zip(eager, graphed), 1):
            rel = abs(a - b) / abs(a)
            bad += rel > TOL
            print(f"rank {dist.get_rank()} step {i}: eager {a:.6f} graphed {b:.6f} rel {rel:.2e}")
        print(f"rank {dist.get_rank()}: wall eager {t_eager:.1f}s, graphed {t_graph:.1f}s")
    flag = torch.tensor([float(bad)], device="cuda")
    dist.all_reduce(flag)
    if dist.get_rank() == 0:
        print("OK" if flag.item() == 0 else f"FAIL: {int(flag.item())} steps differ")
    return 0 if flag.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
