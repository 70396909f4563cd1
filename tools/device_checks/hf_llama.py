"""Device check `hf`: transformers' LlamaForCausalLM at the issue's shape, a plain loop.

    python tools/device_checks/hf_llama.py [--steps 10 --warmup 3] [--device cuda|cpu --tiny]

A reference point for the `plain` and `app` checks: LlamaForCausalLM built from a
LlamaConfig of the same shape (`benchmarks/gpu_mfu.py`'s `ISSUE_SHAPE`: 16 layers, hidden
2048, 16 heads / 8 kv heads, ffn 5632, vocab 32000, untied embeddings, RMSNorm, RoPE),
random weights (no hub, offline), `attn_implementation="sdpa"`, bf16 params, fused
AdamW, one micro-batch (b=4, s=2048) per step. Model TFLOP/s by the same formula as ours
(`pentatron.models.num_floating_point_operations` of the same-shaped config). Prints one
line and `RESULT {json}`; exits non-zero on an error or a non-finite loss.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import _paths

gpu_mfu = _paths.load_benchmark("gpu_mfu")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="gpu_mfu.TINY_SHAPE (smoke runs)")
    args = p.parse_args()

    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from pentatron.models import num_floating_point_operations

    shape = gpu_mfu.TINY_SHAPE if args.tiny else gpu_mfu.ISSUE_SHAPE
    cuda = args.device == "cuda"
    cfg = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.groups, max_position_embeddings=shape.seq,
        rms_norm_eps=1e-5, tie_word_embeddings=False, attention_dropout=0.0,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16).train()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator(device=args.device).manual_seed(1)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), device=args.device, generator=g)

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(step())
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    config = gpu_mfu.model_config(shape)
    flops = num_floating_point_operations(config, shape.seq, shape.vocab, shape.batch)
    out = {
        "transformers": transformers.__version__,
        "attn_implementation": model.config._attn_implementation,
        "params": params,
        "step_s": step_s,
        "tokens_per_s": shape.batch * shape.seq / step_s,
        "tflops": flops / step_s / 1e12,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }
    print(f"LlamaForCausalLM ({params / 1e9:.3f}B params, {out['attn_implementation']}): "
          f"step {step_s * 1e3:.1f} ms, {out['tokens_per_s']:,.0f} tokens/s, "
          f"{out['tflops']:.1f} TFLOP/s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")  # fmt: skip
    print("RESULT " + json.dumps(out))
    return 0 if math.isfinite(losses[-1]) else 1


if __name__ == "__main__":
    sys.exit(main())
