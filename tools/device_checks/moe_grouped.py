"""Device check `moe` (kernel part): GroupedMLP's torch._grouped_mm vs the expert loop.

    python tools/device_checks/moe_grouped.py [--device cuda|cpu] [--tiny]

`pentatron.models.moe.GroupedMLP` and `SequentialMLP` with the same weights (8 experts,
hidden 2048, ffn 1408, SwiGLU, no bias, bf16) on the same expert-major rows (16384 rows =
8192 tokens x top-2, uneven counts drawn from a skewed router-like distribution, one expert
empty): the grouped path must actually run `torch._grouped_mm` here (`use_grouped_mm`),
and the output and the input, fc1 and fc2 grads must agree with the loop within
max|a - b| <= 1e-2 * max|b| (both bf16 GEMMs with fp32 accumulation; only the summation
order differs). Then forward + backward time, medians of 10 after 3 warm-up repeats,
grouped / sequential. Prints the figures and `RESULT {json}`; exits non-zero on a mismatch
or when the grouped GEMM does not run on CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import _paths  # noqa: F401

TOL = 1e-2


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()

    import torch

    from pentatron.models import TransformerConfig
    from pentatron.models.moe import GroupedMLP, SequentialMLP

    h, ffn, experts, rows = (64, 96, 4, 512) if args.tiny else (2048, 1408, 8, 16384)
    dev = torch.device(args.device)
    config = TransformerConfig(
        num_layers=1, hidden_size=h, num_attention_heads=16 if h % 16 == 0 else 4,
        ffn_hidden_size=ffn, activation="swiglu", add_bias_linear=False,
        num_moe_experts=experts, moe_router_topk=2, params_dtype=torch.bfloat16,
    )  # fmt: skip
    torch.manual_seed(0)
    grouped = GroupedMLP(config, experts)
    with torch.no_grad():
        for w in (grouped.linear_fc1.weight, grouped.linear_fc2.weight):
            w.normal_(0.0, 0.02)
    seq = SequentialMLP(config, experts)
    seq.load_state_dict(grouped.state_dict())
    grouped, seq = grouped.to(dev), seq.to(dev)
    weights = torch.tensor([2.0**-i for i in range(experts)])
    weights[-1] = 0.0  # one expert gets no rows
    counts = torch.distributions.Multinomial(rows, weights / weights.sum()).sample().long().tolist()
    x = torch.randn(rows, h, dtype=torch.bfloat16, device=dev)
    grad_out = torch.randn(rows, h, dtype=torch.bfloat16, device=dev)
    used = grouped.use_grouped_mm(x)

    def run(mod):
        mod.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_()
        out = mod(xi, counts)
        out.backward(grad_out)
        return [out.detach(), xi.grad, mod.linear_fc1.weight.grad, mod.linear_fc2.weight.grad]

    errors = {}
    for name, a, b in zip(("out", "dx", "dfc1", "dfc2"), run(grouped), run(seq)):
        scale = b.float().abs().max().clamp_min(1e-12)
        errors[name] = ((a.float() - b.float()).abs().max() / scale).item()
    match = all(e <= TOL for e in errors.values())

    def timed(mod) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(mod)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    tg, ts = [], []
    for i in range(3 + args.reps):
        a, b = timed(grouped), timed(seq)
        if i >= 3:
            tg.append(a)
            ts.append(b)
    t_grp, t_seq = statistics.median(tg), statistics.median(ts)
    out = {
        "grouped_mm_used": used,
        "counts": counts,
        "rel_errors": errors,
        "tolerance": TOL,
        "match": match,
        "grouped_ms": t_grp * 1e3,
        "sequential_ms": t_seq * 1e3,
        "ratio": t_grp / t_seq,
    }
    print(f"grouped_mm used: {used}; rows per expert {counts}")
    print("max rel error vs loop: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
          + f" (tolerance {TOL:g}): {'OK' if match else 'FAIL'}")  # fmt: skip
    print(f"fwd+bwd: grouped {t_grp * 1e3:.2f} ms, sequential {t_seq * 1e3:.2f} ms, "
          f"grouped / sequential = {t_grp / t_seq:.3f}")  # fmt: skip
    print("RESULT " + json.dumps(out))
    ok = match and (used or dev.type != "cuda")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
