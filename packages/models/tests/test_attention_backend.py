"""`attention_backend` (Megatron's --attention-backend) restricts the kernels SDPA may pick:
auto -> SDPA's choice, flash -> FLASH_ATTENTION, fused -> CUDNN + EFFICIENT, unfused and
local -> MATH.

On the CPU the kernel that ran is visible in the autograd graph (the CPU flash kernel's
backward node, or the math kernel's decomposition), and "fused" has no CPU kernel, so SDPA
raises: both prove the restriction reaches the call. Outputs of auto / unfused / local
agree to fp32 rounding (flash and math sum in other orders).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _gpt import small_config

from pentatron.models import GPTModel, ModelConfigError, get_gpt_layer_local_spec
from pentatron.models.sdpa import (
    ATTENTION_BACKENDS,
    attention_backend_needs_cuda,
    grouped_sdpa,
    sdpa_backends,
)
from pentatron.models.te_spec import set_te_attention_env, te_attention_env

FLASH_CPU_NODE = "ScaledDotProductFlashAttentionForCpuBackward0"


def _qkv(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 16, 8, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(2, 2, 16, 8, generator=g).to(dtype).requires_grad_() for _ in "kv")
    return q, k, v


def _graph_names(t: torch.Tensor) -> set[str]:
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn.name() in seen:
            continue
        seen.add(fn.name())
        todo.extend(f for f, _ in fn.next_functions)
    return seen


def test_mapping_and_cuda_helper():
    from torch.nn.attention import SDPBackend as B

    assert sdpa_backends("auto") is None
    assert sdpa_backends("flash") == [B.FLASH_ATTENTION]
    assert sdpa_backends("fused") == [B.CUDNN_ATTENTION, B.EFFICIENT_ATTENTION]
    assert sdpa_backends("unfused") == sdpa_backends("local") == [B.MATH]
    assert [b for b in ATTENTION_BACKENDS if attention_backend_needs_cuda(b)] == ["fused"]


@pytest.mark.parametrize("backend, flash", [("auto", True), ("flash", True), ("unfused", False),
                                            ("local", False)])  # fmt: skip
def test_the_kernel_that_runs_is_the_one_allowed(backend, flash):
    out = grouped_sdpa(*_qkv(), is_causal=True, attention_backend=backend)
    assert (FLASH_CPU_NODE in _graph_names(out)) is flash


def test_fused_has_no_cpu_kernel_so_sdpa_refuses_it():
    with pytest.raises(RuntimeError, match="No viable backend"):
        grouped_sdpa(*_qkv(), is_causal=True, attention_backend="fused")


def _logits_and_grads(backend):
    torch.manual_seed(0)
    model = GPTModel(small_config(attention_backend=backend), get_gpt_layer_local_spec(), 100, 16)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = model(ids, None)
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_auto_unfused_and_local_give_the_same_model_outputs_and_grads():
    ref_logits, ref_grads = _logits_and_grads("auto")
    for backend in ("unfused", "local"):
        logits, grads = _logits_and_grads(backend)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_a_fused_model_on_the_cpu_raises():
    torch.manual_seed(0)
    model = GPTModel(small_config(attention_backend="fused"), get_gpt_layer_local_spec(), 100, 16)
    with pytest.raises(RuntimeError, match="No viable backend"):
        model(torch.zeros(1, 16, dtype=torch.long), None)


def test_restriction_holds_under_torch_compile():
    q, k, v = (t.detach() for t in _qkv())

    def run(q, k, v, backend):
        return grouped_sdpa(q, k, v, is_causal=True, attention_backend=backend)

    compiled = torch.compile(run, fullgraph=True, backend="eager")
    torch.testing.assert_close(
        compiled(q, k, v, "unfused"), run(q, k, v, "auto"), rtol=1e-5, atol=1e-6
    )
    with pytest.raises(Exception, match="No viable backend"):
        compiled(q, k, v, "fused")


def test_fake_device_runs_under_a_restriction():
    """The fake GPU (meta) intercepts SDPA before any kernel is chosen; the restriction's
    context must not get in its way."""
    from pentatron.parallel_state.testing.fake_device import FakeDevice

    q = torch.zeros(2, 8, 32, 16, dtype=torch.bfloat16, device="meta")
    k = v = torch.zeros(2, 2, 32, 16, dtype=torch.bfloat16, device="meta")
    with FakeDevice(compute_dtype=torch.bfloat16):
        out = grouped_sdpa(q, k, v, is_causal=True, attention_backend="flash")
    assert out.shape == q.shape


def test_config_refusals_name_the_field():
    with pytest.raises(ModelConfigError, match=r"attention_backend='cudnn'.*one of"):
        small_config(attention_backend="cudnn")
    # p2p / all_gather blocks run the flash kernel or the maths, never cuDNN's (0.7.1: flash
    # is taken; test_cp_block_kernels checks which kernel each backend runs)
    for kind in ("p2p", "all_gather"):
        with pytest.raises(ModelConfigError, match=r"attention_backend='fused'.*a2a"):
            small_config(attention_backend="fused", context_parallel_size=2, cp_comm_type=kind)
        small_config(attention_backend="flash", context_parallel_size=2, cp_comm_type=kind)
    small_config(attention_backend="fused", context_parallel_size=2, cp_comm_type="a2a")


def test_transformer_engine_switches_are_megatrons(monkeypatch):
    assert te_attention_env("flash") == {
        "NVTE_FLASH_ATTN": "1",
        "NVTE_FUSED_ATTN": "0",
        "NVTE_UNFUSED_ATTN": "0",
    }
    assert set(te_attention_env("auto").values()) == {"1"}
    with pytest.raises(ModelConfigError, match="'local'"):
        te_attention_env("local")
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.setenv(name, "1")  # recorded, so the test's own setting is undone
        monkeypatch.delenv(name)
    set_te_attention_env("fused")
    assert os.environ["NVTE_FUSED_ATTN"] == "1" and os.environ["NVTE_FLASH_ATTN"] == "0"
    with pytest.raises(ModelConfigError, match="NVTE_FLASH_ATTN=0"):
        set_te_attention_env("flash")
