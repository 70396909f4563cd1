"""Device check `cp-blocks` (run_all.py runs it; `--device cpu --tiny` in CI's smoke):

    python tools/device_checks/cp_blocks.py [--device cuda] [--tiny]

Context parallelism's attention blocks (`pentatron.models.context_parallel.softmax_merge`)
as the ring and all-gather kinds run them on one cp rank: its three load-balanced K/V
pairs (its own: the causal diagonal; an earlier rank's: all queries against the first
chunk; a later rank's: the second-half queries against both chunks), merged by online
softmax, then each pair's backward from the final out and lse. The rank holds 2L = 4096
tokens (s 16384 at cp 4), 32 query heads over 8 groups, d 128, b 1, bf16. Two paths: the
fused kernels (`block_kernels`: flash attention with its log-sum-exp) and the unfused
maths (`fused=False`, fp32 score matrices per block).
(1) accuracy at 2L = 1024: both paths against the maths in fp32 on the same bf16 inputs,
    max|a - b| / max|b| of out, lse, dq, dk, dv within 2e-2 (fp32 on the CPU: 1e-5);
(2) on CUDA, the kernel family the fused path launches (`_kernels.sdpa_backend`): flash;
(3) ms per forward + backward of the three pairs (median of 5 after 2 warm-up calls),
    fused / maths, and the peak memory of each (CUDA).
Prints one line per path and `RESULT {json}`; exits non-zero on a failure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import _paths  # noqa: F401
import torch
from _kernels import device_kernels, sdpa_backend

from pentatron.models.context_parallel import softmax_merge as sm

CASES = ("diag", "lower", "upper")


def shapes(tiny: bool) -> tuple[dict, dict]:
    """(timed shape, accuracy shape): b, n heads, g groups, 2L tokens, d."""
    if tiny:
        return dict(b=1, n=4, g=2, s=64, d=16), dict(b=1, n=4, g=2, s=64, d=16)
    return dict(b=1, n=32, g=8, s=4096, d=128), dict(b=1, n=32, g=8, s=1024, d=128)


def inputs(shape: dict, dtype, device, seed: int = 0):
    """q `[b, n, 2L, d]`, the three pairs' k/v `[b, g, 2L, d]`, dout like q."""
    g = torch.Generator(device=device).manual_seed(seed)
    b, n, groups, s, d = (shape[k] for k in ("b", "n", "g", "s", "d"))

    def rnd(heads):
        return torch.randn(b, heads, s, d, device=device, dtype=dtype, generator=g)

    return rnd(n), [(rnd(groups), rnd(groups)) for _ in CASES], rnd(n)


def pairs(q, kvs, dout, fused: bool) -> dict[str, torch.Tensor]:
    """One cp rank's forward over its three pairs and their backward -> out, lse, dq,
    and dk / dv of each pair (fp32)."""
    scale = q.size(-1) ** -0.5
    out = lse = None
    for case, (k, v) in zip(CASES, kvs, strict=True):
        out, lse = sm.pair_forward(case, q, k, v, scale, out, lse, fused=fused)
    delta = (dout.float() * out).sum(-1)
    res = {"out": out, "lse": lse, "dq": torch.zeros_like(out)}
    for case, (k, v) in zip(CASES, kvs, strict=True):
        dq, dkv, rows, _ = sm.pair_grads(case, q, k, v, out, lse, dout, delta, scale, fused=fused)
        res["dq"][:, :, rows] += dq
        res["dk " + case], res["dv " + case] = dkv[0], dkv[1]
    return res


def rel_errors(got: dict, want: dict) -> dict[str, float]:
    return {
        name: ((got[name] - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
        for name, b in want.items()
    }


def timed_ms(device, call, reps: int = 5, warmup: int = 2) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def check(device, dtype, tiny: bool) -> dict:
    timed_shape, small_shape = shapes(tiny)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    small = inputs(small_shape, dtype, device)
    q, kvs, dout = small
    reference = pairs(q.float(), [(k.float(), v.float()) for k, v in kvs], dout.float(), False)
    out: dict = {}
    big = inputs(timed_shape, dtype, device, seed=1)
    for name, fused in (("fused", True), ("maths", False)):
        r: dict = {"problems": []}
        r["rel_errors"] = rel_errors(pairs(*small, fused=fused), reference)
        for what, err in r["rel_errors"].items():
            if not err <= tol:
                r["problems"].append(f"{what} relative error {err:.2e} > {tol:.0e}")
        if device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                pairs(*big, fused=fused)
                torch.cuda.synchronize()
            r["backend"] = sdpa_backend(sorted(device_kernels(prof)))
            if fused and r["backend"] != "flash":
                r["problems"].append(f"the fused path ran {r['backend']}, not flash")
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        r["ms"] = timed_ms(device, lambda fused=fused: pairs(*big, fused=fused))
        if device.type == "cuda":
            r["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        r["ok"] = not r["problems"]
        out[name] = r
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="small shapes (the CPU smoke)")
    opts = p.parse_args()
    if opts.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        print("RESULT " + json.dumps({"status": "SKIP", "note": "needs CUDA"}))
        return 0
    device = torch.device(opts.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = check(device, dtype, opts.tiny)
    out["fused_over_maths"] = out["fused"]["ms"] / out["maths"]["ms"]
    for name in ("fused", "maths"):
        r = out[name]
        kernel = f", kernel {r['backend']}" if "backend" in r else ""
        peak = f", peak {r['peak_mib']:.0f} MiB" if "peak_mib" in r else ""
        print(
            f"{name}: {'OK' if r['ok'] else 'FAIL'} {r['ms']:.2f} ms fwd+bwd of 3 pairs{kernel}"
            f"{peak}; max rel error {max(r['rel_errors'].values()):.1e}"
            + ("; " + ", ".join(r["problems"]) if r["problems"] else "")
        )
    print(f"fused / maths time: {out['fused_over_maths']:.2f}")
    print("RESULT " + json.dumps({"dtype": str(dtype).removeprefix("torch."), **out}))
    return 0 if out["fused"]["ok"] and out["maths"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
