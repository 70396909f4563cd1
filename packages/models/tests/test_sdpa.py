"""`takes_grouped_kv`: which (device, dtype, mask, head dim) hand SDPA grouped k/v as they
are (`enable_gqa`) and which repeat them to all query heads first.

The CUDA side is pinned here as a rule (no GPU in CI) and checked on a GPU by
tools/device_checks/sdpa_gqa.py (the kernel that runs must not be math): flash takes grouped
k/v in fp16/bf16; in fp32 only math would, so k/v are repeated and the memory-efficient
kernel runs. CPU's flash kernel takes grouped k/v in every dtype (checked below).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pentatron.models import sdpa
from pentatron.models.sdpa import grouped_sdpa, takes_grouped_kv

HALF = (torch.bfloat16, torch.float16)
ALL = (torch.float32, *HALF)


def rule(device_type, dtype, *, rep=4, mask=False, d=128):
    return takes_grouped_kv(rep, mask, d, dtype=dtype, device_type=device_type)


def test_cuda_fp32_repeats_and_half_precision_stays_grouped():
    assert rule("cuda", torch.float32) is False
    for dtype in HALF:
        assert rule("cuda", dtype) is True


@pytest.mark.parametrize("dtype", ALL)
def test_cpu_keeps_grouped_kv_in_every_dtype(dtype):
    assert rule("cpu", dtype) is True


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", ALL)
def test_mask_long_heads_and_plain_mha_never_take_grouped_kv(device_type, dtype):
    assert rule(device_type, dtype, mask=True) is False
    assert rule(device_type, dtype, d=sdpa.MAX_GQA_HEAD_DIM + 1) is False
    assert rule(device_type, dtype, rep=1) is False
    assert rule(device_type, dtype, d=sdpa.MAX_GQA_HEAD_DIM) is (
        device_type == "cpu" or dtype in HALF
    )


def test_device_and_dtype_are_required():
    with pytest.raises(TypeError):
        takes_grouped_kv(4, False, 128)  # type: ignore[call-arg]


@pytest.mark.parametrize("dtype", ALL)
def test_cpu_flash_kernel_runs_grouped_kv(dtype):
    """What the CPU rule relies on: the flash kernel alone runs grouped k/v, fwd + bwd."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 32, 16, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(2, 2, 32, 16, generator=g).to(dtype).requires_grad_() for _ in "kv")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.float().sum().backward()
    assert k.grad is not None and k.grad.shape == k.shape


@pytest.mark.parametrize("mask", [False, True])
def test_grouped_sdpa_follows_the_rule(monkeypatch, mask):
    """grouped_sdpa asks the rule with q's dtype and device: grouped k/v reach SDPA as
    they are, or repeated to all heads with enable_gqa off."""
    seen = {}
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.update(kv_heads=k.size(1), enable_gqa=kw["enable_gqa"])
        return real(q, k, v, **kw)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", spy)
    q, k, v = torch.randn(1, 8, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    attn_mask = torch.ones(16, 16, dtype=torch.bool).tril() if mask else None
    out = grouped_sdpa(q, k, v, attn_mask=attn_mask, is_causal=not mask)
    assert seen == ({"kv_heads": 8, "enable_gqa": False} if mask else
                    {"kv_heads": 2, "enable_gqa": True})  # fmt: skip
    ref = real(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=attn_mask,
               is_causal=not mask)  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_other_devices_follow_cuda():
    """The fake GPU of the dry run (meta) takes CUDA's rule, so it runs CUDA's kernels."""
    assert rule("meta", torch.float32) is False
    assert rule("meta", torch.bfloat16) is True


@pytest.mark.parametrize("dtype", ALL)
def test_fake_gpu_runs_a_fused_kernel_in_every_dtype(dtype, monkeypatch):
    """On the fake GPU (CUDA's kernel choice), grouped attention never reaches SDPA's math
    kernel: flash in bf16/fp16, memory-efficient on repeated k/v in fp32. Handing fp32 the
    grouped k/v (the rule before) is caught as the math fallback."""
    from pentatron.parallel_state.testing.fake_device import DeviceDisciplineError, FakeDevice

    q = torch.zeros(2, 8, 32, 16, dtype=dtype, device="meta")
    k = v = torch.zeros(2, 2, 32, 16, dtype=dtype, device="meta")
    with FakeDevice(compute_dtype=dtype) as dev:
        out = sdpa.grouped_sdpa(q, k, v, is_causal=True)
    assert out.shape == q.shape
    assert dev.sdpa_kernels == ["flash" if dtype in HALF else "efficient"]
    monkeypatch.setattr(sdpa, "takes_grouped_kv", lambda *a, **kw: True)
    if dtype not in HALF:
        with pytest.raises(DeviceDisciplineError, match="math kernel"), FakeDevice():
            sdpa.grouped_sdpa(q, k, v, is_causal=True)


def test_fake_gpu_takes_memory_efficient_for_a_value_head_of_its_own():
    """MLA: q / k heads of d_qk + d_pe dims, v of d_v. CUDA's flash kernel needs one head
    size for q, k and v, so the memory-efficient kernel runs, giving `[.., d_v]`."""
    from pentatron.parallel_state.testing.fake_device import FakeDevice

    q = k = torch.zeros(2, 4, 32, 24, dtype=torch.bfloat16, device="meta")
    v = torch.zeros(2, 4, 32, 16, dtype=torch.bfloat16, device="meta")
    with FakeDevice(compute_dtype=torch.bfloat16) as dev:
        out = sdpa.grouped_sdpa(q, k, v, is_causal=True)
    assert dev.sdpa_kernels == ["efficient"] and out.shape == (2, 4, 32, 16)
