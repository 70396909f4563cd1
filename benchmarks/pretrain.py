"""pentatron-pretrain training throughput at 1 process, as a ratio against plain PyTorch.

    python benchmarks/pretrain.py [--num-layers 4] [--hidden-size 128] [--reps 9] [--threads 1]

The README's main job's GPT (4 layers, hidden 128, 4 heads, SwiGLU, RMSNorm, RoPE, tied
embeddings, no biases, vocab 4096, seq 128, micro-batch 4, global batch 32: 8 micro-batches
per step at dp=1), trained two ways on the same synthetic batches (random token ids, fixed
seed, dicts of tokens / labels / loss_mask / position_ids `[micro_batch, seq]` as the app's
data loader yields):

- ours: the app's own pieces at world size 1 (gloo): `parse_args` + `validate_args`,
  `initialize`, `setup_model_and_optimizer` with `pretrain_gpt.model_provider`,
  `gpt_step.make_forward_step`, `make_pipeline_config` and one `train_step` per step (zero
  the grad buffers, the no-pipelining schedule over the 8 micro-batches, finalize the grads,
  the loss-finite vote, `DistributedOptimizer`/`MixedPrecisionOptimizer` step with clipping);
- plain: a minimal GPT written here (`nn.Embedding` tied with the output projection,
  `nn.RMSNorm`, fused-qkv causal self-attention with rotary embeddings and
  `F.scaled_dot_product_attention(is_causal=True)`, SwiGLU MLP with fused gate/up) trained
  by a textbook loop: 8 x (`F.cross_entropy` / 8, backward), `clip_grad_norm_`,
  `torch.optim.AdamW.step()` (default implementation, same hyperparameters, no weight
  decay on 1-d params as ours), `zero_grad()`.

One step (8 micro-batches fwd + bwd, clip, optimizer step, zero grad) is timed on each
side, the sides alternating rep by rep after `--warmup` steps each; tokens/s is
global_batch * seq / median step time. Goal: ours / plain >= 0.95 in tokens/s. The
median process CPU time per step (all threads) is printed too: on a loaded machine the
wall-clock ratio swings with the scheduler, the CPU-time ratio much less. The parameter
counts must match, and both first-step losses are printed next to ln(vocab) as a sanity
check. Times are medians of `--reps` interleaved steps in this run; only the ratio
is meant to be compared across machines. About a minute with the defaults on a 2-core
machine.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import time
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


# --- synthetic data (shared by both sides) --------------------------------------------------
def make_batches(args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    """One global batch as `micro_batches` dicts, the app's collate format."""
    g = torch.Generator().manual_seed(args.data_seed)
    m = args.global_batch_size // args.micro_batch_size
    out = []
    for _ in range(m):
        ids = torch.randint(
            0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=g
        )
        out.append(
            {
                "tokens": ids[:, :-1].contiguous(),
                "labels": ids[:, 1:].contiguous(),
                "loss_mask": torch.ones(args.micro_batch_size, args.seq_length),
                "position_ids": torch.arange(args.seq_length)
                .expand(args.micro_batch_size, -1)
                .contiguous(),
            }
        )
    return out


def cycle(batches: list[dict[str, torch.Tensor]]):
    while True:
        yield from batches


# --- plain PyTorch GPT ----------------------------------------------------------------------
def rotary(seq: int, dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.arange(seq).float()[:, None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)  # [s, d]
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, eps: float) -> None:
        super().__init__()
        self.heads, self.ffn = heads, ffn
        self.norm1 = nn.RMSNorm(hidden, eps=eps)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.RMSNorm(hidden, eps=eps)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, n, s, d]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class PlainGPT(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        h, eps = args.hidden_size, args.norm_epsilon
        self.embed = nn.Embedding(args.vocab_size, h)
        self.blocks = nn.ModuleList(
            Block(h, args.num_attention_heads, args.ffn_hidden_size, eps)
            for _ in range(args.num_layers)
        )
        self.norm = nn.RMSNorm(h, eps=eps)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=args.init_method_std)
        cos, sin = rotary(args.seq_length, h // args.num_attention_heads, args.rotary_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = F.linear(self.norm(x), self.embed.weight)  # tied output projection
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


def plain_side(args: argparse.Namespace, batches) -> tuple[Any, nn.Module]:
    torch.manual_seed(args.seed)
    model = PlainGPT(args)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() == 1]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
    )
    params = list(model.parameters())
    m = len(batches)

    def step() -> float:
        total = 0.0
        for b in batches:
            loss = model(b["tokens"], b["labels"]) / m
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, args.clip_grad)
        opt.step()
        opt.zero_grad()
        return total

    return step, model


# --- ours: the app's pieces at world size 1 -------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_argv(args: argparse.Namespace) -> list[str]:
    argv = [
        "--num-layers", str(args.num_layers),
        "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.num_attention_heads),
        "--seq-length", str(args.seq_length),
        "--max-position-embeddings", str(args.seq_length),
        "--hidden-dropout", "0",
        "--attention-dropout", "0",
        "--transformer-impl", "local",
        "--micro-batch-size", str(args.micro_batch_size),
        "--global-batch-size", str(args.global_batch_size),
        "--lr", str(args.lr),
        "--clip-grad", str(args.clip_grad),
        "--weight-decay", str(args.weight_decay),
        "--adam-beta1", str(args.adam_beta1),
        "--adam-beta2", str(args.adam_beta2),
        "--adam-eps", str(args.adam_eps),
        "--normalization", "RMSNorm",
        "--norm-epsilon", str(args.norm_epsilon),
        "--position-embedding-type", "rope",
        "--rotary-base", str(args.rotary_base),
        "--init-method-std", str(args.init_method_std),
        "--vocab-size", str(args.vocab_size),
        "--seed", str(args.seed),
        "--swiglu",
        "--disable-bias-linear",
        "--mock-data",
        "--train-iters", "1000",
        "--device", "cpu",
    ]  # fmt: skip
    return argv


def our_side(args: argparse.Namespace, batches) -> tuple[Any, Any, Any, Any]:
    from pentatron.pretrain.arguments import parse_args, validate_args
    from pentatron.pretrain.gpt_step import make_forward_step
    from pentatron.pretrain.pretrain_gpt import model_provider
    from pentatron.pretrain.training import configs
    from pentatron.pretrain.training.setup import initialize, setup_model_and_optimizer
    from pentatron.pretrain.training.step import make_pipeline_config, train_step

    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    app = validate_args(parse_args(app_argv(args)), world_size=1)
    grid = initialize(app)
    provider = partial(model_provider, app, grid, args.vocab_size)
    chunks, optimizer, _scheduler = setup_model_and_optimizer(provider, app, grid)
    forward_step = make_forward_step(grid, app.micro_batch_size, app.seq_length)
    pcfg = make_pipeline_config(app, chunks, grid, configs.pipeline_config, optimizer)
    iterators = [cycle(batches)]
    m = app.global_batch_size // app.micro_batch_size

    def step() -> float | None:
        return train_step(app, chunks, iterators, forward_step, optimizer, pcfg, grid, m).loss

    return step, app, chunks, (grid, optimizer)


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process: all its threads) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def interleaved(a, b, reps: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """Median (wall, CPU) seconds of `a` and of `b`, alternating which runs first each rep."""
    ta, tb = [], []
    for rep in range(reps):
        pair = (a, b) if rep % 2 == 0 else (b, a)
        for fn in pair:
            (ta if fn is a else tb).append(timed(fn))

    def med(ts: list[tuple[float, float]]) -> tuple[float, float]:
        return statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)

    return med(ta), med(tb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip-grad", type=float, default=1.0)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--adam-beta1", type=float, default=0.9)
    parser.add_argument("--adam-beta2", type=float, default=0.95)
    parser.add_argument("--adam-eps", type=float, default=1e-8)
    parser.add_argument("--norm-epsilon", type=float, default=1e-5)
    parser.add_argument("--rotary-base", type=float, default=10000.0)
    parser.add_argument("--init-method-std", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=1234, help="model init seed")
    parser.add_argument("--data-seed", type=int, default=0, help="synthetic batches seed")
    parser.add_argument("--reps", type=int, default=9, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.global_batch_size % args.micro_batch_size:
        parser.error("--global-batch-size must be a multiple of --micro-batch-size")

    import torch.distributed as dist

    batches = make_batches(args)
    ours, app, chunks, (grid, _opt) = our_side(args, batches)
    args.ffn_hidden_size = app.ffn_hidden_size  # the app's SwiGLU default, for the plain GPT
    plain, model = plain_side(args, batches)
    try:
        n_ours = sum(p.numel() for c in chunks for p in c.module.parameters())
        n_plain = sum(p.numel() for p in model.parameters())
        m = len(batches)
        tokens = args.global_batch_size * args.seq_length
        print(
            f"GPT {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} "
            f"heads, SwiGLU ffn {app.ffn_hidden_size}, vocab {args.vocab_size}, seq "
            f"{args.seq_length}, micro-batch {args.micro_batch_size} x {m} = global batch "
            f"{args.global_batch_size} ({tokens} tokens/step); fp32, CPU, {args.threads} "
            f"thread(s), median of {args.reps} interleaved steps after {args.warmup} warm-up"
        )
        print(f"params: ours {n_ours:,}   plain {n_plain:,}")
        if n_ours != n_plain:
            raise SystemExit(f"parameter counts differ: ours {n_ours} vs plain {n_plain}")
        loss_ours, loss_plain = ours(), plain()
        ln_v = math.log(args.vocab_size)
        print(
            f"first-step loss: ours {loss_ours:.4f}   plain {loss_plain:.4f}   ln(vocab) {ln_v:.4f}"
        )
        for name, loss in (("ours", loss_ours), ("plain", loss_plain)):
            if loss is None or abs(loss - ln_v) > 0.1:
                raise SystemExit(f"{name}: first-step loss {loss} not within 0.1 of ln(vocab)")
        for _ in range(max(args.warmup - 1, 0)):
            ours(), plain()
        (t_ours, c_ours), (t_plain, c_plain) = interleaved(ours, plain, args.reps)
        tps_ours, tps_plain = tokens / t_ours, tokens / t_plain
        ratio = tps_ours / tps_plain
        print(
            f"step: ours (train_step) {t_ours * 1e3:8.1f} ms  {tps_ours:9.0f} tokens/s   "
            f"plain PyTorch {t_plain * 1e3:8.1f} ms  {tps_plain:9.0f} tokens/s"
        )
        print(
            f"process CPU time per step: ours {c_ours * 1e3:8.1f} ms   plain {c_plain * 1e3:8.1f} ms"
            f"   ratio plain/ours {c_plain / c_ours:.3f}  (a check on machine load: on an idle "
            "machine it is close to the wall-clock ratio)"
        )
        print(
            f"ratio ours/plain (tokens/s) {ratio:.3f}  "
            f"(goal >= 0.95: {'met' if ratio >= 0.95 else 'NOT met'})"
        )
    finally:
        from pentatron.parallel_state import destroy_model_parallel

        destroy_model_parallel(grid)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
