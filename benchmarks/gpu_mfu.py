"""Model TFLOP/s and MFU of a ~1B-parameter GPT in bf16 on CUDA (not part of CI).

    python benchmarks/gpu_mfu.py [--steps 10] [--peak-tflops 989] [--allow-cpu-skip]
    torchrun --nproc-per-node N benchmarks/gpu_mfu.py        # tp = N on one node

Model: 16 layers, hidden 2048, 16 heads (GQA 8 groups), SwiGLU ffn 5632, RMSNorm, RoPE,
vocab 32000, seq 2048, micro-batch `--batch` (~1.2B params), bf16 params and activations,
torch AdamW (fused) on the bf16 params. Under torchrun the layout is tp = world size with
sequence parallelism (the only layout that fits every world size of one node).
FLOPs per step by Megatron's formula, `pentatron.models.num_floating_point_operations`
(12 b s L h^2 (attention + MLP + logits terms), forward + backward, no recompute);
model TFLOP/s per GPU = FLOPs / median step time / world size; MFU = that / the device's
dense bf16 peak (table `PEAK_TFLOPS`, matched on the device name, or `--peak-tflops`).
The first `--warmup` steps are not timed. A few minutes at most on one H100/H200.

Without CUDA it prints why and exits 1, or 0 with `--allow-cpu-skip` (for scripts that
run it everywhere). It has not been run on a GPU in this repository's CI or dev machines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity), by device-name substring.
PEAK_TFLOPS = (
    ("H200", 989.0), ("H100 SXM", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0),
    ("GH200", 989.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0),
    ("L4", 121.0), ("A10", 125.0), ("A6000", 155.0), ("RTX 4090", 165.0),
)  # fmt: skip


def device_peak(name: str) -> float | None:
    for key, peak in PEAK_TFLOPS:
        if key in name:
            return peak
    return None


def model_config(tp: int, layers: int):
    from pentatron.models import TransformerConfig

    return TransformerConfig(
        num_layers=layers, hidden_size=2048, num_attention_heads=16, num_query_groups=8,
        ffn_hidden_size=5632, activation="swiglu", normalization="RMSNorm",
        add_bias_linear=False, position_embedding_type="rope", attention_dropout=0.0,
        hidden_dropout=0.0, params_dtype=torch.bfloat16, sequence_parallel=tp > 1,
        tensor_model_parallel_size=tp,
    )  # fmt: skip


def init_distributed() -> int:
    if "WORLD_SIZE" not in os.environ:  # plain `python`: one rank of its own
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    return dist.get_world_size()


def run(args: argparse.Namespace) -> dict[str, float]:
    from pentatron.models import GPTModel, get_gpt_layer_local_spec, num_floating_point_operations
    from pentatron.parallel_state import ParallelConfig, initialize_model_parallel

    world = init_distributed()
    grid = initialize_model_parallel(ParallelConfig(tp=world))
    config = model_config(world, args.layers)
    torch.manual_seed(0)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=32000,
                     max_sequence_length=args.seq, grid=grid).cuda()  # fmt: skip
    n_params = sum(p.numel() for p in model.parameters()) * world  # tp shards, roughly
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 32000, (args.batch, args.seq), device="cuda", generator=g)
    pos = torch.arange(args.seq, device="cuda").expand(args.batch, -1)

    def step() -> float:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, pos, labels=ids).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()  # synchronises

    times = []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    flops = num_floating_point_operations(config, args.seq, model.padded_vocab_size, args.batch)
    tflops = flops / step_s / world / 1e12
    return {"world": world, "params": n_params, "step_s": step_s, "tflops": tflops,
            "mem_gib": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="micro-batch size")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the table")
    parser.add_argument("--allow-cpu-skip", action="store_true", help="exit 0 without CUDA")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_mfu: no CUDA device here (torch.cuda.is_available() is False); this "
              "benchmark needs a GPU. Nothing measured.")  # fmt: skip
        return 0 if args.allow_cpu_skip else 1
    res = run(args)
    name = torch.cuda.get_device_name()
    peak = args.peak_tflops or device_peak(name)
    if dist.get_rank() == 0:
        mfu = (
            f"MFU {res['tflops'] / peak:.1%} of {peak:g} TFLOP/s"
            if peak
            else ("MFU: unknown peak for this device, pass --peak-tflops")
        )
        print(f"{name} x{res['world']} (tp={res['world']}), {res['params'] / 1e9:.2f}B params, "
              f"b={args.batch} s={args.seq}: step {res['step_s'] * 1e3:.1f} ms, "
              f"{res['tflops']:.1f} model TFLOP/s per GPU, {mfu}, "
              f"peak mem {res['mem_gib']:.1f} GiB")  # fmt: skip
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
