"""Fused kernels for context parallelism's blocks (`context_parallel.block_kernels`).

- The three load-balanced pairs of a cp rank (its own K/V: the causal diagonal; an earlier
  rank's: every query against the first chunk; a later rank's: the second-half queries
  against both chunks), merged by online softmax as the ring and all-gather kinds do,
  equal an fp64 autograd reference written here (softmax over the union of the pairs'
  keys under the same masks): the output and the final lse, and, from the final out and
  lse, dq and each pair's dk, dv. GQA (8 heads over 4 groups). fp32 within 1e-5 (measured
  about 1e-6); bf16 within 4x the error of one bf16 SDPA call and 1.5 % (see `_check`).
- On the CPU the causal blocks run ATen's flash kernel (its calls counted by a dispatch
  mode) and no tensor as large as a block's [sq, sk] scores is created; windowed blocks
  (a `keep` mask) and fp64 take the maths, and so would a value head dim unlike the
  query's (MLA); bf16 on meta (the app's fake GPU) takes the CUDA kernel.
- The CUDA kernel's calls (flash attention 2, k/v repeated to the query heads) bind, and
  their results have the expected shapes and dtypes, on meta tensors (no GPU here).
- Planted: a block backward given its own (block-local) out and lse instead of the final
  ones, the classic ring-attention bug, fails the comparison (`_check` raises).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from pentatron.models.context_parallel import block_kernels as bk
from pentatron.models.context_parallel import softmax_merge as sm

B, N, G, L, D = 2, 8, 4, 16, 8  # a cp rank's two chunks of L tokens each
SCALE = D**-0.5
CASES = ("diag", "lower", "upper")


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, 2 * L, D, generator=g)
    kvs = [(torch.randn(B, G, 2 * L, D, generator=g), torch.randn(B, G, 2 * L, D, generator=g))
           for _ in CASES]  # fmt: skip
    dout = torch.randn(B, N, 2 * L, D, generator=g)
    return q.to(dtype), [(k.to(dtype), v.to(dtype)) for k, v in kvs], dout.to(dtype)


def _ring(q, kvs, dout, fused=True):
    """out, lse, dq, [(dk, dv) per pair] as the cp kinds compute them (fp32)."""
    out = lse = None
    for case, (k, v) in zip(CASES, kvs, strict=True):
        out, lse = sm.pair_forward(case, q, k, v, SCALE, out, lse, fused=fused)
    delta = (dout.float() * out).sum(-1)
    dq, dkv = torch.zeros_like(out), []
    for case, (k, v) in zip(CASES, kvs, strict=True):
        dq_p, dkv_p, rows, kv_rows = sm.pair_grads(
            case, q, k, v, out, lse, dout, delta, SCALE, fused=fused
        )
        dq[:, :, rows] += dq_p
        full = torch.zeros((2, *k.shape), dtype=torch.float32)
        full[:, :, :, kv_rows] = dkv_p
        dkv.append(full)
    return out, lse, dq, dkv


def _allowed() -> torch.Tensor:
    """`[2L, 6L]`: which of the union's keys (the three pairs' K/V, concatenated) each query
    sees under the pairs' causal masks."""
    i = torch.arange(2 * L).view(-1, 1)
    j = torch.arange(2 * L).view(1, -1)
    diag = j <= i
    lower = (j < L).expand(2 * L, 2 * L)  # every query, the first chunk only
    upper = (i >= L).expand(2 * L, 2 * L)  # the second-half queries, both chunks
    return torch.cat([diag, lower, upper], 1)


def _union(q, kvs, dout, dtype, sdpa=False):
    """Autograd in `dtype` of q against the union of the pairs' keys -> out, lse (None
    with `sdpa`: one masked `F.scaled_dot_product_attention` call), dq, [(dk, dv)]."""
    q = q.to(dtype).requires_grad_()
    kvs = [(k.to(dtype).requires_grad_(), v.to(dtype).requires_grad_()) for k, v in kvs]
    rep = N // G
    keys = torch.cat([k.repeat_interleave(rep, 1) for k, _ in kvs], 2)
    values = torch.cat([v.repeat_interleave(rep, 1) for _, v in kvs], 2)
    if sdpa:
        lse = None
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=_allowed(), scale=SCALE)
    else:
        scores = (q @ keys.transpose(-1, -2) * SCALE).masked_fill(~_allowed(), float("-inf"))
        lse = torch.logsumexp(scores, -1).detach()
        out = torch.softmax(scores, -1) @ values
    out.backward(dout.to(dtype))
    dkv = [torch.stack([k.grad, v.grad]) for k, v in kvs]
    return out.detach(), lse, q.grad, dkv


def _errors(got, want):
    """Max absolute error of each result -> {name: (error, max |reference|)}."""
    out, lse, dq, dkv = got
    r_out, r_lse, r_dq, r_dkv = want
    pairs = {"out": (out, r_out), "lse": (lse, r_lse), "dq": (dq, r_dq)}
    pairs.update({"dkv " + c: ab for c, *ab in zip(CASES, dkv, r_dkv, strict=True)})
    return {
        name: (float((a.double() - b).abs().max()), float(b.abs().max()))
        for name, (a, b) in pairs.items()
        if a is not None
    }


def _check(dtype, seed=0):
    """fp32: within 1e-5 of the fp64 reference. bf16: within 4x the error of one bf16 SDPA
    call on the union and 1.5 % of the largest value (20 seeds measured: up to 3.7x and
    1.04 %; the maths: about 1x. The kernels return each block's output in bf16, so the
    merged output the backward's delta is formed from carries one more rounding)."""
    q, kvs, dout = _inputs(dtype, seed)
    ref = _union(q, kvs, dout, torch.float64)
    fused = _errors(_ring(q, kvs, dout), ref)
    if dtype == torch.float32:
        for name, (err, _) in fused.items():
            assert err <= 1e-5, (name, err)
        return fused
    sdpa = _errors(_union(q, kvs, dout, dtype, sdpa=True), ref)
    for name, (err, big) in fused.items():
        assert err <= 1.5e-2 * big, (name, err, big)
        assert name not in sdpa or err <= 4 * sdpa[name][0], (name, err, sdpa[name])
    return fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_pairs_equal_an_fp64_reference(dtype):
    q, kvs, dout = _inputs(dtype)
    fused = _check(dtype)
    maths = _errors(_ring(q, kvs, dout, fused=False), _union(q, kvs, dout, torch.float64))
    assert fused != maths  # the fused kernel ran: its rounding differs from the maths'


class _Ops(TorchDispatchMode):
    """Names of the ATen ops run, and the largest tensor any of them returned."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        res = func(*args, **(kwargs or {}))
        self.names.append(func.overloadpacket.__name__)
        for t in res if isinstance(res, (tuple, list)) else (res,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return res


def _run_counted(q, kvs, dout, fused=True):
    with _Ops() as ops:
        _ring(q, kvs, dout, fused)
    return ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_causal_blocks_run_flash_and_build_no_score_matrix(dtype):
    q, kvs, dout = _inputs(dtype)
    ops = _run_counted(q, kvs, dout)
    assert ops.names.count("_scaled_dot_product_flash_attention_for_cpu") == 3
    assert ops.names.count("_scaled_dot_product_flash_attention_for_cpu_backward") == 3
    scores = B * N * (2 * L) * L  # the smallest block's scores: half the queries x 2L keys
    assert ops.largest < scores, ops.largest
    maths = _run_counted(q, kvs, dout, fused=False)  # the counter sees the maths' scores
    assert "_scaled_dot_product_flash_attention_for_cpu" not in maths.names
    assert maths.largest >= B * N * (2 * L) ** 2


def test_windows_fp64_and_mla_dims_take_the_maths():
    q, kvs, _ = _inputs(torch.float32)
    k, v = kvs[0]
    assert bk.fused_kernel(q, k, v) == "flash_cpu"
    assert bk.fused_kernel(q.double(), k.double(), v.double()) is None
    k_wide = torch.randn(B, G, 2 * L, 2 * D)  # MLA: q/k head dim unlike v's
    assert bk.fused_kernel(torch.randn(B, N, 2 * L, 2 * D), k_wide, v) is None
    assert bk.fused_kernel(q.to("meta"), k.to("meta"), v.to("meta")) is None  # fp32
    meta = [x.to("meta", torch.bfloat16) for x in (q, k, v)]  # the dry run's fake GPU
    assert bk.fused_kernel(*meta) == "flash_cuda"
    keep = torch.ones(2 * L, 2 * L, dtype=torch.bool).tril()
    with _Ops() as ops:
        sm.block_forward(q, k, v, SCALE, False, keep)
    assert "_scaled_dot_product_flash_attention_for_cpu" not in ops.names
    q64, kvs64, dout64 = _inputs(torch.float64)  # fp64 end to end: the maths
    assert (
        "_scaled_dot_product_flash_attention_for_cpu" not in _run_counted(q64, kvs64, dout64).names
    )


def test_cuda_flash_calls_bind_on_meta():
    """The CUDA branch (not run here): its ATen calls accept our arguments and return
    out [b, n, sq, d] fp32, lse [b, n, sq] fp32, dq like q and dk/dv folded to g heads."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    q = torch.empty(B, N, L, D, **meta)
    k, v = torch.empty(B, G, 2 * L, D, **meta), torch.empty(B, G, 2 * L, D, **meta)
    out, lse = bk.fused_forward("flash_cuda", q, k, v, SCALE, False)
    assert (out.shape, out.dtype) == ((B, N, L, D), torch.float32)
    assert (lse.shape, lse.dtype) == ((B, N, L), torch.float32)
    dq, dk, dv = bk.fused_backward("flash_cuda", q, k, v, out, lse, out, SCALE, False)
    assert (dq.shape, dk.shape, dv.shape) == ((B, N, L, D), (B, G, 2 * L, D), (B, G, 2 * L, D))
    assert {dq.dtype, dk.dtype, dv.dtype} == {torch.float32}


def test_planted_block_local_softmax_fails(monkeypatch):
    """A block backward normalised by its own lse and out (not the final ones)."""
    real = bk.fused_backward

    def local(kernel, q, k, v, out, lse, dout, scale, causal):
        own_out, own_lse = bk.fused_forward(kernel, q, k, v, scale, causal)
        return real(kernel, q, k, v, own_out, own_lse, dout, scale, causal)

    monkeypatch.setattr(sm, "fused_backward", local)
    with pytest.raises(AssertionError, match=r"dq|dkv"):
        _check(torch.float32)


# --- attention_backend at cp2, through DotProductAttention (gloo) -------------------------
S_CP = 16  # tokens over cp = 2: chunks of 4


def _full_inputs():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(S_CP, B, N, D, generator=g)
    k, v = (torch.randn(S_CP, B, G, D, generator=g) for _ in range(2))
    return q, k, v, torch.randn(S_CP, B, N * D, generator=g)


def _cp_backends(kind: str) -> dict:
    """Per attention_backend: (out, dq, dk, dv) of this cp rank's shard, and its flash calls;
    "flash" in fp64: the error and the cp collectives started before it."""
    from pentatron.models import ModelConfigError, TransformerConfig
    from pentatron.models.attention import DotProductAttention
    from pentatron.models.context_parallel import shard_for_cp_rank
    from pentatron.parallel_state import (
        ParallelConfig,
        comm,
        destroy_model_parallel,
        initialize_model_parallel,
    )

    grid = initialize_model_parallel(ParallelConfig(cp=2))
    out: dict = {}
    try:
        rank = grid.rank("cp")
        shards = [shard_for_cp_rank(x, 2, rank, dim=0) for x in _full_inputs()]
        for backend in ("auto", "flash", "unfused", "local", "flash-fp64"):
            config = TransformerConfig(
                num_layers=1,
                hidden_size=N * D,
                num_attention_heads=N,
                num_query_groups=G,
                context_parallel_size=2,
                cp_comm_type=kind,
                attention_dropout=0.0,
                attention_backend=backend.removesuffix("-fp64"),
            )
            attn = DotProductAttention(config, 1, 1)
            attn.set_cp_group(grid.group("cp"))
            dtype = torch.float64 if backend.endswith("fp64") else torch.float32
            q, k, v = (x.to(dtype).clone().requires_grad_() for x in shards[:3])
            if dtype == torch.float64:
                with comm.trace() as ledger:
                    try:
                        attn(q, k, v)
                    except ModelConfigError as e:
                        out[backend] = (str(e), len(ledger.records))
                continue
            with _Ops() as ops:
                o = attn(q, k, v)
                o.backward(shards[3])
            flash = ops.names.count("_scaled_dot_product_flash_attention_for_cpu")
            out[backend] = ((o.detach(), q.grad, k.grad, v.grad), flash)
    finally:
        destroy_model_parallel(grid)
    return out


@pytest.mark.parametrize("kind", ["p2p", "all_gather"])
def test_attention_backend_picks_the_blocks_kernel(distributed, kind):
    """auto and flash: the blocks call the flash kernel; unfused and local (Megatron's
    PyTorch attention): the maths, no flash call. All
    four equal one process's causal SDPA on the whole sequence (fp32, 1e-5). flash where
    the blocks have no flash kernel (fp64) raises ModelConfigError naming the field, before
    any cp collective."""
    from pentatron.models.context_parallel import gather_cp_shards

    q, k, v, dout = (x.requires_grad_(x.dim() == 4) for x in _full_inputs())
    qb, kb, vb = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=SCALE, enable_gqa=True)
    ref = ref.permute(2, 0, 1, 3).reshape(S_CP, B, -1)
    ref.backward(dout)
    want = (ref.detach(), q.grad, k.grad, v.grad)
    ranks = distributed.run(2, _cp_backends, kind)
    for backend in ("auto", "flash", "unfused", "local"):
        calls = [r[backend][1] for r in ranks]
        assert all(c > 0 for c in calls) if backend in ("auto", "flash") else calls == [0, 0]
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            got = gather_cp_shards([r[backend][0][i] for r in ranks], dim=0)
            torch.testing.assert_close(got, want[i], rtol=1e-5, atol=1e-5, msg=(backend, name))
    for r in ranks:
        message, collectives = r["flash-fp64"]
        assert message.startswith("attention_backend='flash' with context parallelism: the rule")
        assert "fix: attention_backend='auto'" in message and collectives == 0
