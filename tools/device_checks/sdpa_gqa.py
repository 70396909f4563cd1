"""Device check `sdpa` (run where CUDA exists; run_all.py runs it, not part of CI):

    python tools/device_checks/sdpa_gqa.py

`pentatron.models.sdpa.grouped_sdpa` (causal, 32 query heads over 8 k/v groups, head dim
128, s 2048, b 2) in bf16, fp16 and fp32. `takes_grouped_kv` decides per dtype whether
SDPA gets the grouped k/v (`enable_gqa`; bf16/fp16 on CUDA) or k/v repeated to all heads
(fp32 on CUDA: the memory-efficient kernel, which runs fp32, does not take grouped k/v).
For each dtype the check
(1) runs forward + backward with only the flash, memory-efficient and cuDNN kernels
    allowed (`torch.nn.attention.sdpa_kernel`): an error means only math would run;
(2) names the kernel family SDPA picks by itself (no restriction), from the kernel names
    in a torch.profiler trace (`_kernels.sdpa_backend`: cudnn / flash / efficient / math):
    it must not be math;
(3) compares the output and the q, k, v grads with SDPA over k/v repeated to all heads
    (max|a - b| / max|b| within 2e-2 bf16, 2e-3 fp16, 1e-4 fp32);
(4) with grouped k/v, keeps less memory for forward + backward than the repeated path
    (peak allocated bytes).
Prints one line per dtype and `RESULT {json}`; exits non-zero on a failure.
"""

import json
import sys

import _paths  # noqa: F401
import torch
import torch.nn.functional as F
from _kernels import device_kernels, sdpa_backend
from torch.nn.attention import SDPBackend, sdpa_kernel

from pentatron.models.sdpa import grouped_sdpa, takes_grouped_kv

FAST = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-4}


def run(fn, q, k, v):
    """(output, grads of q, k, v, peak bytes) of one forward + backward."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(q, k, v)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    return out.detach(), q.grad, k.grad, v.grad, torch.cuda.max_memory_allocated() - base


def repeated(q, k, v):
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def ours(q, k, v):
    return grouped_sdpa(q, k, v, is_causal=True)


def kernels_of(q, k, v) -> list[str]:
    """Kernel names of one unrestricted forward + backward of `grouped_sdpa`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(ours, q, k, v)
    return sorted(device_kernels(prof))


def check(dtype) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    b, n, groups, s, d = 2, 32, 8, 2048, 128
    q = torch.randn(b, n, s, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, groups, s, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, groups, s, d, device="cuda", dtype=dtype, generator=g)
    grouped = takes_grouped_kv(n // groups, False, d, dtype=dtype, device_type="cuda")
    res = {"grouped_kv": grouped, "ok": True, "problems": []}
    name = str(dtype).removeprefix("torch.")
    try:
        with sdpa_kernel(FAST):
            got = run(ours, q, k, v)
    except RuntimeError as e:
        res["problems"].append(f"needs the math kernel: {str(e).splitlines()[0]}")
        res["ok"] = False
        got = run(ours, q, k, v)
    names = kernels_of(q, k, v)
    res["backend"] = sdpa_backend(names)
    res["attention_kernels"] = [
        x for x in names if any(w in x.lower() for w in ("flash", "fmha", "attention", "sdpa"))
    ]
    if res["backend"] == "math":
        res["problems"].append("SDPA ran the math kernel")
        res["ok"] = False
    ref = run(repeated, q, k, v)
    res["rel_errors"] = {}
    for key, a, r in zip(("out", "dq", "dk", "dv"), got[:4], ref[:4]):
        err = ((a.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-6)).item()
        res["rel_errors"][key] = err
        if err > TOL[dtype]:
            res["problems"].append(f"{key} relative error {err:.2e} > {TOL[dtype]:.0e}")
            res["ok"] = False
    res["peak_mib"] = {"ours": got[4] / 2**20, "repeated": ref[4] / 2**20}
    if grouped and not got[4] < ref[4]:
        res["problems"].append("grouped k/v kept no less memory than repeated k/v")
        res["ok"] = False
    print(
        f"{name}: {'OK' if res['ok'] else 'FAIL'} {'grouped' if grouped else 'repeated'} k/v, "
        f"kernel {res['backend']}, peak {res['peak_mib']['ours']:.0f} MiB vs "
        f"{res['peak_mib']['repeated']:.0f} MiB repeated; "
        + (", ".join(res["problems"]) or "matches the repeated path")
    )
    return res


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        print("RESULT " + json.dumps({"status": "SKIP", "note": "needs CUDA"}))
        return 0
    out = {str(dt).removeprefix("torch."): check(dt) for dt in (torch.bfloat16, torch.float16,
                                                               torch.float32)}  # fmt: skip
    print("RESULT " + json.dumps(out))
    return 0 if all(r["ok"] for r in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
