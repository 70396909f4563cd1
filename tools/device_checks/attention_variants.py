"""Device check `variants` (run_all.py runs it; `--device cpu --tiny` in CI's smoke):

    python tools/device_checks/attention_variants.py [--device cuda] [--tiny]

gpt-oss's attention as the models run it (`pentatron.models.attention_variants.variant_sdpa`):
learnable softmax sinks (one padded sink key, an explicit mask), a sliding window of 128
keys (blockwise: queries in blocks of 128, each with the keys it can see), and both,
against plain causal grouped SDPA, at gpt-oss-20b's attention shape (64 query heads over 8
k/v groups, head dim 64; b 1, s 4096; bf16). For each variant:
(1) forward + backward within 2e-2 (bf16; fp32 on the CPU: 1e-4) of Megatron's unfused
    maths in fp32 at s 512 (scores, the causal and window mask, the sink's column in the
    softmax): max|a - b| / max|b| of the output and of the q, k, v and sink grads;
(2) on CUDA, the kernel family SDPA runs (`_kernels.sdpa_backend`): it must not be math;
(3) ms per forward + backward (median of 10 after 3 warm-up calls) and the ratio to the
    plain causal call's, and the peak memory (CUDA).
Prints one line per variant and `RESULT {json}`; exits non-zero on a failure.
"""

from __future__ import annotations

import json
import math
import sys

import _paths  # noqa: F401
import torch
from _kernel_timing import measure, parse_device

from pentatron.models.attention_variants import variant_sdpa

WINDOW = 127  # keys back: Megatron's window (127, 0), gpt-oss's 128 keys with the query's
VARIANTS = {  # name: (sinks, window)
    "causal": (False, None),
    "sinks": (True, None),
    "window": (False, WINDOW),
    "sinks+window": (True, WINDOW),
}


def shapes(tiny: bool) -> tuple[dict, dict]:
    """(timed shape, accuracy shape): b, n heads, g groups, s, d."""
    if tiny:  # the CPU smoke: the same code paths (3+ window blocks at s 64 with window 15)
        return dict(b=1, n=4, g=2, s=64, d=16), dict(b=1, n=4, g=2, s=64, d=16)
    return dict(b=1, n=64, g=8, s=4096, d=64), dict(b=1, n=64, g=8, s=512, d=64)


def inputs(shape: dict, dtype, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    b, n, groups, s, d = (shape[k] for k in ("b", "n", "g", "s", "d"))
    q = torch.randn(b, n, s, d, device=device, dtype=dtype, generator=g)
    k = torch.randn(b, groups, s, d, device=device, dtype=dtype, generator=g)
    v = torch.randn(b, groups, s, d, device=device, dtype=dtype, generator=g)
    sinks = torch.randn(n, device=device, dtype=dtype, generator=g)
    return q, k, v, sinks


def ours(q, k, v, sinks, variant: str, window: int):
    with_sinks, win = VARIANTS[variant]
    return variant_sdpa(
        q,
        k,
        v,
        sinks=sinks if with_sinks else None,
        window=None if win is None else window,
        keep=None,
        dropout_p=0.0,
        scale=1.0 / math.sqrt(q.size(-1)),
        attention_backend="auto",
    )


def reference(q, k, v, sinks, variant: str, window: int):
    """Megatron's unfused maths, fp32: softmax over [scores | sink] with the sink dropped."""
    with_sinks, win = VARIANTS[variant]
    q, k, v, sinks = (x.float() for x in (q, k, v, sinks))
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q.size(2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    i = torch.arange(s, device=q.device).view(s, 1)
    j = torch.arange(s, device=q.device).view(1, s)
    keep = j <= i
    if win is not None:
        keep = keep & (j >= i - window)
    scores = scores.masked_fill(~keep, float("-inf"))
    if with_sinks:
        column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return probs @ v


def forward_backward(fn, q, k, v, sinks, variant, window, grad=None):
    """(output, grads of q, k, v, sinks) of one forward + backward."""
    q, k, v, sinks = (x.detach().clone().requires_grad_() for x in (q, k, v, sinks))
    out = fn(q, k, v, sinks, variant, window)
    out.backward(torch.ones_like(out) if grad is None else grad)
    return out.detach(), q.grad, k.grad, v.grad, sinks.grad


def rel_errors(variant, got, want) -> dict[str, float]:
    names = ("out", "dq", "dk", "dv", "dsinks")
    errors = {}
    for name, a, b in zip(names, got, want, strict=True):
        if name == "dsinks" and not VARIANTS[variant][0]:
            continue  # no sinks: no gradient reaches them
        b = b.float()
        errors[name] = ((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
    return errors


def check(variant: str, device, dtype, tiny: bool) -> dict:
    timed_shape, small_shape = shapes(tiny)
    window = 15 if tiny else WINDOW
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    res: dict = {"problems": []}
    small = inputs(small_shape, dtype, device)
    got = forward_backward(ours, *small, variant, window)
    want = forward_backward(reference, *small, variant, window)
    res["rel_errors"] = rel_errors(variant, got, want)
    for name, err in res["rel_errors"].items():
        if not err <= tol:
            res["problems"].append(f"{name} relative error {err:.2e} > {tol:.0e}")
    big = inputs(timed_shape, dtype, device, seed=1)
    res.update(measure(device, lambda: forward_backward(ours, *big, variant, window)))
    if res.get("backend") == "math":
        res["problems"].append("SDPA ran the math kernel")
    res["ok"] = not res["problems"]
    return res


def main() -> int:
    parsed = parse_device(__doc__)
    if parsed is None:
        return 0
    device, dtype, tiny = parsed
    torch.manual_seed(0)
    out = {name: check(name, device, dtype, tiny) for name in VARIANTS}
    for name, r in out.items():
        r["vs_causal"] = r["ms"] / out["causal"]["ms"]
        kernel = f", kernel {r['backend']}" if "backend" in r else ""
        peak = f", peak {r['peak_mib']:.0f} MiB" if "peak_mib" in r else ""
        worst = max(r["rel_errors"].values())
        print(
            f"{name}: {'OK' if r['ok'] else 'FAIL'} {r['ms']:.2f} ms fwd+bwd "
            f"({r['vs_causal']:.2f}x causal){kernel}{peak}; max rel error {worst:.1e}"
            + ("; " + ", ".join(r["problems"]) if r["problems"] else "")
        )
    print("RESULT " + json.dumps({"dtype": str(dtype).removeprefix("torch."), **out}))
    return 0 if all(r["ok"] for r in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
