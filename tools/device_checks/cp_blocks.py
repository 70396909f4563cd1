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

import json
import sys

import _paths  # noqa: F401
import torch
from _kernel_timing import measure, parse_device

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
        r.update(measure(device, lambda fused=fused: pairs(*big, fused=fused), reps=5, warmup=2))
        if fused and "backend" in r and r["backend"] != "flash":
            r["problems"].append(f"the fused path ran {r['backend']}, not flash")
        r["ok"] = not r["problems"]
        out[name] = r
    return out


def main() -> int:
    parsed = parse_device(__doc__)
    if parsed is None:
        return 0
    device, dtype, tiny = parsed
    out = check(device, dtype, tiny)
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
