"""MoE layer compute: grouped vs sequential experts, and our MoELayer vs transformers'
MixtralSparseMoeBlock on the same input and weights (single process, forward + backward).

Prints `grouped / sequential` (expert compute only, the same permuted tokens) and
`ours / transformers` (the whole layer: router, permute, experts, combine), medians over
`--reps` interleaved repeats after warm-up. Asserts first that the outputs agree. GroupedMLP
runs torch._grouped_mm wherever torch has it for the device and dtype (CUDA bf16 SM90+, CPU
fp32/bf16 on recent torch; `grouped_mm=` says which) and otherwise the same loop (ratio ~1).

    python benchmarks/moe.py [--hidden 256 --ffn 512 --experts 8 --topk 2 --tokens 2048
                              --reps 10 --device cpu|cuda --dtype fp32|bf16 --threads 0]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (
        ("hidden", 256), ("ffn", 512), ("experts", 8), ("topk", 2), ("tokens", 2048),
        ("reps", 10), ("warmup", 2), ("threads", 0),
    ):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    return p.parse_args()


def _time(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _build(args, device, dtype):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from pentatron.models import TransformerConfig
    from pentatron.models.moe import MoELayer
    from pentatron.tp_layers import init_method_normal

    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=1, ffn_hidden_size=args.ffn,
        activation="swiglu", add_bias_linear=False, num_moe_experts=args.experts,
        moe_router_topk=args.topk, moe_router_load_balancing_type="none", params_dtype=dtype,
    )  # fmt: skip
    torch.manual_seed(0)
    ours = MoELayer(config, init_method=init_method_normal(0.02)).to(device)
    hf_config = MixtralConfig(
        hidden_size=args.hidden, intermediate_size=args.ffn, num_local_experts=args.experts,
        num_experts_per_tok=args.topk, router_jitter_noise=0.0,
    )  # fmt: skip
    theirs = MixtralSparseMoeBlock(hf_config).to(device=device, dtype=dtype)
    with torch.no_grad():  # same weights: fc1 holds [gate, up] like gate_up_proj
        theirs.gate.weight.copy_(ours.router.weight)
        theirs.experts.gate_up_proj.copy_(ours.experts.linear_fc1.weight)
        theirs.experts.down_proj.copy_(ours.experts.linear_fc2.weight)
    return config, ours, theirs


def _step_ours(layer, x):
    out, _ = layer(x)
    out.float().square().mean().backward()
    return out


def _step_theirs(block, x):
    out = block(x.transpose(0, 1))
    out.float().square().mean().backward()
    return out.transpose(0, 1)


def _median_pair(a, b, reps, warmup, device) -> tuple[float, float]:
    ta, tb = [], []
    for i in range(warmup + reps):
        da, db = _time(a, device), _time(b, device)
        if i >= warmup:
            ta.append(da)
            tb.append(db)
    return statistics.median(ta), statistics.median(tb)


def main() -> None:
    args = _args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from pentatron.models.moe import GroupedMLP, SequentialMLP, permute

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    config, ours, theirs = _build(args, device, dtype)
    x = torch.randn(args.tokens, 1, args.hidden, device=device, dtype=dtype)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(_step_ours(ours, x), _step_theirs(theirs, x), **tol)

    _probs, routing_map = ours.router(x)
    permuted, _ = permute(x.reshape(-1, args.hidden), routing_map)
    counts = routing_map.sum(0).tolist()
    grouped = GroupedMLP(config, args.experts).to(device)
    grouped.load_state_dict(ours.experts.state_dict())
    seq = SequentialMLP(config, args.experts).to(device)
    seq.load_state_dict(ours.experts.state_dict())
    permuted = permuted.detach()
    torch.testing.assert_close(grouped(permuted, counts), seq(permuted, counts), **tol)

    def run(mod):
        return lambda: mod(permuted, counts).float().square().mean().backward()

    t_grp, t_seq = _median_pair(run(grouped), run(seq), args.reps, args.warmup, device)
    t_ours, t_hf = _median_pair(
        lambda: _step_ours(ours, x),
        lambda: _step_theirs(theirs, x),
        args.reps,
        args.warmup,
        device,
    )
    print(f"device={device} dtype={args.dtype} grouped_mm={grouped.use_grouped_mm(permuted)}")
    print(f"experts: grouped {t_grp * 1e3:.2f} ms, sequential {t_seq * 1e3:.2f} ms, "
          f"ratio = grouped / sequential = {t_grp / t_seq:.3f}")  # fmt: skip
    print(f"layer: ours {t_ours * 1e3:.2f} ms, transformers {t_hf * 1e3:.2f} ms, "
          f"ratio = ours / transformers = {t_ours / t_hf:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
