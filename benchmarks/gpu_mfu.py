"""Model TFLOP/s and MFU of a ~0.89B-parameter GPT in bf16 on CUDA, in a plain loop (not CI).

    python benchmarks/gpu_mfu.py [--steps 10] [--compile none|layers|model]
                                 [--peak-tflops 989] [--allow-cpu-skip]
    torchrun --nproc-per-node N benchmarks/gpu_mfu.py        # tp = N on one node

Model (`ISSUE_SHAPE`, the shape of issue #20): 16 layers, hidden 2048, 16 heads (GQA 8
groups), SwiGLU ffn 5632 (fused bias-SwiGLU, as the app's default), RMSNorm, RoPE, untied
embeddings, no linear biases, vocab 32000, seq 2048, micro-batch `--batch` 4 (~0.89B
params). bf16 params and activations (no autocast, as the app with --bf16), one micro-batch
per step, torch AdamW (fused) on the bf16 params: the loop the training app is measured
against (`tools/device_checks/run_all.py`'s `plain` check calls `measure` here). Under
torchrun the layout is tp = world size with sequence parallelism.
`--compile layers` compiles each transformer layer (`nn.Module.compile`, torchtitan's way:
one graph reused by every layer); `model` compiles the whole GPTModel's forward.
FLOPs per step by Megatron's formula, `pentatron.models.num_floating_point_operations`
(12 b s L h^2 (attention + MLP + logits terms), forward + backward, no recompute);
model TFLOP/s per GPU = FLOPs / median step time / world size; MFU = that / the device's
dense bf16 peak (table `PEAK_TFLOPS`, matched on the device name, or `--peak-tflops`).
The first `--warmup` steps (compilation included) are not timed.

Without CUDA it prints why and exits 1, or 0 with `--allow-cpu-skip` (for scripts that
run it everywhere); `measure` itself also runs on CPU (the device check's smoke mode).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity), by device-name substring.
PEAK_TFLOPS = (
    ("H200", 989.0), ("H100 SXM", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0),
    ("GH200", 989.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0),
    ("L4", 121.0), ("A10", 125.0), ("A6000", 155.0), ("RTX 4090", 165.0),
)  # fmt: skip


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped GPT and its batch: `batch` sequences of `seq` tokens per step."""

    layers: int = 16
    hidden: int = 2048
    heads: int = 16
    groups: int = 8
    ffn: int = 5632
    vocab: int = 32000
    seq: int = 2048
    batch: int = 4


ISSUE_SHAPE = Shape()
TINY_SHAPE = Shape(layers=2, hidden=64, heads=4, groups=2, ffn=176, vocab=512, seq=64, batch=2)


def device_peak(name: str) -> float | None:
    for key, peak in PEAK_TFLOPS:
        if key in name:
            return peak
    return None


def model_config(shape: Shape, tp: int = 1, dtype: torch.dtype = torch.bfloat16):
    """The TransformerConfig the app builds from the same flags (see run_all's app flags)."""
    from pentatron.models import TransformerConfig

    return TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.groups, ffn_hidden_size=shape.ffn, activation="swiglu",
        bias_activation_fusion=True, normalization="RMSNorm", add_bias_linear=False,
        position_embedding_type="rope", untie_embeddings_and_output_weights=True,
        attention_dropout=0.0, hidden_dropout=0.0, params_dtype=dtype,
        sequence_parallel=tp > 1, tensor_model_parallel_size=tp,
    )  # fmt: skip


def init_distributed(backend: str = "nccl") -> int:
    if "WORLD_SIZE" not in os.environ:  # plain `python`: one rank of its own
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return dist.get_world_size()


def build_model(shape: Shape, grid, device: str, dtype: torch.dtype = torch.bfloat16):
    """(GPTModel on `device`, its config) at tp = the grid's tp size."""
    from pentatron.models import GPTModel, get_gpt_layer_local_spec

    config = model_config(shape, grid.size("tp"), dtype)
    torch.manual_seed(0)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=shape.vocab,
                     max_sequence_length=shape.seq, grid=grid).to(device)  # fmt: skip
    return model, config


def compile_model(model, mode: str) -> str:
    """Compile in place: "layers" each transformer layer, "model" the whole forward."""
    if mode == "layers":
        for layer in model.decoder.layers:
            layer.compile()
        return f"torch.compile per transformer layer ({len(model.decoder.layers)} layers)"
    if mode == "model":
        model.compile()
        return "torch.compile of the whole GPTModel forward"
    raise ValueError(f"compile mode {mode!r}: the rule: 'layers' or 'model'")


def measure(
    model, config, shape: Shape, optimizer, *, steps: int, warmup: int, device: str
) -> dict[str, float]:
    """Train `warmup + steps` steps of one micro-batch each; figures of the timed ones.

    Step: forward to the per-token loss, mean, backward, `optimizer.step()`, zero_grad.
    Returns median step seconds, tokens/s, model TFLOP/s per device (world = tp ranks
    doing one model's work), the first and last loss and the peak memory (CUDA)."""
    from pentatron.models import num_floating_point_operations

    cuda = torch.device(device).type == "cuda"
    world = dist.get_world_size() if dist.is_initialized() else 1
    g = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), device=device, generator=g)
    pos = torch.arange(shape.seq, device=device).expand(shape.batch, -1)

    def step() -> float:
        loss = model(ids, pos, labels=ids).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()  # synchronises

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(step())
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    flops = num_floating_point_operations(config, shape.seq, model.padded_vocab_size, shape.batch)
    return {
        "step_s": step_s,
        "tokens_per_s": shape.batch * shape.seq / step_s,
        "tflops": flops / step_s / world / 1e12,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "steps": steps,
        "warmup": warmup,
    }  # fmt: skip


def make_optimizer(model):
    """torch AdamW on the model's own (bf16) params; fused where the device has it."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def run(args: argparse.Namespace) -> dict[str, float]:
    from pentatron.parallel_state import ParallelConfig, initialize_model_parallel

    world = init_distributed()
    grid = initialize_model_parallel(ParallelConfig(tp=world))
    shape = Shape(layers=args.layers, seq=args.seq, batch=args.batch)
    model, config = build_model(shape, grid, "cuda")
    n_params = sum(p.numel() for p in model.parameters()) * world  # tp shards, roughly
    mode = "eager" if args.compile == "none" else compile_model(model, args.compile)
    opt = make_optimizer(model)
    res = measure(model, config, shape, opt, steps=args.steps, warmup=args.warmup, device="cuda")
    return {**res, "world": world, "params": n_params, "mode": mode}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=ISSUE_SHAPE.batch, help="micro-batch size")
    parser.add_argument("--seq", type=int, default=ISSUE_SHAPE.seq)
    parser.add_argument("--layers", type=int, default=ISSUE_SHAPE.layers)
    parser.add_argument("--compile", default="none", choices=["none", "layers", "model"])
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
              f"b={args.batch} s={args.seq}, {res['mode']}: step {res['step_s'] * 1e3:.1f} ms, "
              f"{res['tokens_per_s']:,.0f} tokens/s, {res['tflops']:.1f} model TFLOP/s per "
              f"GPU, {mfu}, peak mem {res['mem_gib']:.1f} GiB")  # fmt: skip
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
