"""Fused attention kernels for one block of context parallelism.

A cp block's forward must return its log-sum-exp (the online-softmax merge needs it), and
its backward must take the FINAL output and lse (the block's share of the whole softmax:
p = exp(s - lse), delta = sum(dout * out)). `F.scaled_dot_product_attention` exposes
neither; ATen's flash-attention operators do, and compute a block in tiles without an
`[sq, sk]` score matrix (the unfused maths of `softmax_merge` materialises several, in
fp32, per block and head). torch's own context parallelism
(`torch.distributed.tensor.experimental`) calls the same operators the same way.

- "flash_cpu": `aten._scaled_dot_product_flash_attention_for_cpu` (+ `_backward`): fp32,
  bf16, fp16; grouped k/v (GQA) taken as they are.
- "flash_cuda": `aten._scaled_dot_product_flash_attention` (+ `_backward`), flash
  attention 2: bf16 / fp16, head dim a multiple of 8 up to 256, sm80 or newer; k/v are
  repeated to the query heads and their grads summed back (the operator's grouped-head
  support is not assumed).

On the meta device (the app's fake-GPU dry run) the CUDA choice is made, and its calls
run on ATen's meta kernels. Neither kernel computes a block masked by a window (gpt-oss's:
the callers pass `keep`), a value head dim unlike the query's (MLA), fp64, or another
device: those take the unfused maths, which is also the reference the fused path is tested
against. Precision: the kernels sum in fp32 and return a 16-bit model's block output and
grads in its dtype, where the maths keeps them in fp32 until the merge (the rounding of
one block result, as in Transformer Engine's and torch's cp attention).
"""

from __future__ import annotations

import torch

_CPU = (torch.float32, torch.bfloat16, torch.float16)
_CUDA = (torch.bfloat16, torch.float16)
_SM80: dict[int, bool] = {}
_RNG: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
aten = torch.ops.aten


def _sm80(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM80:
        _SM80[index] = torch.cuda.get_device_capability(index) >= (8, 0)
    return _SM80[index]


def fused_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """The fused kernel for the block q `[b, n, sq, d]`, k/v `[b, g, sk, d]` on their device
    and dtype, or None where only the unfused maths applies."""
    d = q.size(-1)
    if k.size(-1) != d or v.size(-1) != d or not (q.dtype == k.dtype == v.dtype):
        return None
    if q.device.type == "cpu" and q.dtype in _CPU:
        return "flash_cpu"
    if q.device.type in ("cuda", "meta") and q.dtype in _CUDA and d % 8 == 0 and d <= 256:
        # meta stands for the GPU in the app's fake-device dry run: the CUDA operators
        # have meta kernels, so their calls run there with the app's real shapes
        return "flash_cuda" if q.device.type == "meta" or _sm80(q.device) else None
    return None


def repeat_heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def fold_heads(dx: torch.Tensor, rep: int) -> torch.Tensor:
    """`[b, g*rep, s, d]` -> `[b, g, s, d]`: sum the grads of the repeated heads."""
    if rep == 1:
        return dx
    b, n, s, d = dx.shape
    return dx.view(b, n // rep, rep, s, d).sum(2)


def _rng_placeholders(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (rng state, offset) tensors the CUDA backward takes: unused without dropout, but
    typed; taken once per device from a tiny forward, as a forward would hand them on."""
    key = str(q.device)
    if key not in _RNG:
        x = torch.zeros(1, 1, 8, 8, dtype=q.dtype, device=q.device)
        res = aten._scaled_dot_product_flash_attention(x, x, x, 0.0, False, False)
        _RNG[key] = (res[6], res[7])
    return _RNG[key]


def fused_forward(
    kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out `[b, n, sq, d]` fp32, lse `[b, n, sq]` fp32) of softmax(q k^T scale) v, causal
    with the corner top-left (callers use it only on square blocks)."""
    if kernel == "flash_cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
    else:
        rep = q.size(1) // k.size(1)
        res = aten._scaled_dot_product_flash_attention(
            q, repeat_heads(k, rep), repeat_heads(v, rep), 0.0, causal, False, scale=scale
        )
        out, lse = res[0], res[1]
    return _dense_fp32(out), _dense_fp32(lse)


def _dense_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, laid out contiguously. The kernels lay out out and lse as [b, sq, n, .]
    (b > 1); through the merge that layout would reach the ring's output and decide
    whether the caller's `[s, b, n d]` reshape copies it or aliases the saved output, by
    batch size and pair order: the memory calculator counts the copy, as the maths'
    layouts always gave."""
    if x.dtype == torch.float32 and x.is_contiguous():
        return x
    return torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x)


def fused_backward(
    kernel: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grads of one block from the FINAL out `[b, n, sq, d]` and lse `[b, n, sq]` (this
    block's query rows) -> (dq `[b, n, sq, d]`, dk, dv `[b, g, sk, d]`), fp32."""
    out, dout, lse = out.to(q.dtype), dout.to(q.dtype), lse.float().contiguous()
    if kernel == "flash_cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
        return dq.float(), dk.float(), dv.float()
    rep = q.size(1) // k.size(1)
    seed, offset = _rng_placeholders(q)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        dout,
        q,
        repeat_heads(k, rep),
        repeat_heads(v, rep),
        out,
        lse,
        None,  # cumulative sequence lengths: dense, not varlen
        None,
        q.size(2),
        k.size(2),
        0.0,
        causal,
        seed,
        offset,
        scale=scale,
    )
    return dq.float(), fold_heads(dk.float(), rep), fold_heads(dv.float(), rep)
