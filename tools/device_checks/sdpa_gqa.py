"""GPU check (run where CUDA exists; not part of CI):

    python tools/device_checks/sdpa_gqa.py

`pentatron.models.sdpa.grouped_sdpa` hands SDPA grouped k/v (`enable_gqa`) when there is
no mask and heads are at most 256 dims. On CUDA this must (1) run without the math kernel:
the call is made with only the flash, memory-efficient and cuDNN kernels allowed, and an
error here means the grouped path would fall back to math for that dtype; (2) give the
outputs and grads of SDPA over k/v repeated to all heads; (3) keep less memory for
backward (peak allocated bytes of forward + backward). Checked in bf16 and fp16 (flash)
and fp32 (memory-efficient). Prints one line per case; exits non-zero on a failure.
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pentatron.models.sdpa import grouped_sdpa

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


def check(dtype) -> bool:
    g = torch.Generator(device="cuda").manual_seed(0)
    b, n, groups, s, d = 2, 32, 8, 2048, 128
    q = torch.randn(b, n, s, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, groups, s, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, groups, s, d, device="cuda", dtype=dtype, generator=g)
    try:
        with sdpa_kernel(FAST):
            got = run(lambda q, k, v: grouped_sdpa(q, k, v, is_causal=True), q, k, v)
    except RuntimeError as e:
        print(f"{dtype}: FAIL grouped k/v needs the math kernel: {str(e).splitlines()[0]}")
        return False
    ref = run(repeated, q, k, v)
    ok = True
    for name, a, r in zip(("out", "dq", "dk", "dv"), got[:4], ref[:4]):
        err = ((a.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-6)).item()
        if err > TOL[dtype]:
            print(f"{dtype}: FAIL {name} relative error {err:.2e} > {TOL[dtype]:.0e}")
            ok = False
    less = got[4] < ref[4]
    print(
        f"{dtype}: {'OK' if ok and less else 'FAIL'} peak {got[4] / 2**20:.0f} MiB grouped "
        f"vs {ref[4] / 2**20:.0f} MiB repeated"
    )
    return ok and less


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        return 1
    results = [check(dt) for dt in (torch.bfloat16, torch.float16, torch.float32)]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
