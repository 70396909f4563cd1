"""Device check `plain`: the app's GPTModel in a plain training loop, eager then compiled.

    python tools/device_checks/plain_loop.py [--steps 10 --warmup 3 --compile layers]
                                             [--device cuda|cpu --tiny]

The baseline the training app is measured against (`run_all.py`: app / plain tokens/s):
the same GPTModel (`pentatron.models`, built by `benchmarks/gpu_mfu.py`'s `build_model` at
the issue's shape), bf16 params, `torch.optim.AdamW(fused=True)`, ONE micro-batch (b=4,
s=2048) per optimizer step, no DDP, no fp32 main params. First eager, then the same model
and optimizer with `torch.compile` per transformer layer (`--compile model`: the whole
forward), each timed over `--steps` steps after `--warmup` (compilation happens there).
Prints one line per mode and a `RESULT {json}` line for run_all.py; exits non-zero on an
error or a non-finite loss.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import _paths

gpu_mfu = _paths.load_benchmark("gpu_mfu")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", default="layers", choices=["none", "layers", "model"])
    p.add_argument("--compile-warmup", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="gpu_mfu.TINY_SHAPE (smoke runs)")
    args = p.parse_args()

    import torch

    from pentatron.parallel_state import ParallelConfig, initialize_model_parallel

    shape = gpu_mfu.TINY_SHAPE if args.tiny else gpu_mfu.ISSUE_SHAPE
    gpu_mfu.init_distributed("nccl" if args.device == "cuda" else "gloo")
    grid = initialize_model_parallel(ParallelConfig(tp=1))
    model, config = gpu_mfu.build_model(shape, grid, args.device, torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    opt = gpu_mfu.make_optimizer(model)
    out = {"params": params, "shape": vars(shape), "tokens_per_step": shape.batch * shape.seq}
    kw = {"steps": args.steps, "device": args.device}
    out["eager"] = gpu_mfu.measure(model, config, shape, opt, warmup=args.warmup, **kw)
    _line("eager", out["eager"])
    print("RESULT " + json.dumps(out), flush=True)  # kept if compiling runs out of time
    if args.compile != "none":
        out["compile_mode"] = gpu_mfu.compile_model(model, args.compile)
        out["compiled"] = gpu_mfu.measure(
            model, config, shape, opt, warmup=args.compile_warmup, **kw
        )
        _line(out["compile_mode"], out["compiled"])
    print("RESULT " + json.dumps(out))
    finite = all(math.isfinite(r["loss_last"]) for r in (out["eager"], out.get("compiled", {}))
                 if r)  # fmt: skip
    return 0 if finite else 1


def _line(label: str, r: dict) -> None:
    print(f"{label}: step {r['step_s'] * 1e3:.1f} ms, {r['tokens_per_s']:,.0f} tokens/s, "
          f"{r['tflops']:.1f} TFLOP/s, loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}",
          flush=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
