"""All-to-all attention (cp_comm_type="a2a", DeepSpeed-Ulysses).

    q [s/cp, b, n, d] -> all-to-all(cp): sequence shards -> head shards -> [s, b, n/cp, d]
      (rank-major chunks, reordered to 0..2cp-1) -> causal SDPA -> inverse order
      -> all-to-all(cp) back -> [s/cp, b, n, d]
Heads and query groups split over cp in contiguous parts, so q head part j still belongs
to k/v group part j (GQA). Backward: each all-to-all's grad is the inverse all-to-all.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pentatron.parallel_state import comm

from ..attention_variants import variant_sdpa
from ..config import ModelConfigError


def _a2a(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()  # empty_like would keep a permuted input's strides
    out = torch.empty_like(x)
    comm.all_to_all_single(out, x, group=group)
    return out


def _seq_to_head(x: torch.Tensor, group: Any) -> torch.Tensor:
    """`[s/cp, b, n, d]` -> `[s, b, n/cp, d]` (rank-major sequence shards)."""
    cp = dist.get_world_size(group)
    s, b, n, d = x.shape
    parts = x.reshape(s, b, cp, n // cp, d).permute(2, 0, 1, 3, 4)  # [cp, s/cp, b, n/cp, d]
    return _a2a(parts, group).reshape(cp * s, b, n // cp, d)


def _head_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """`[s, b, n/cp, d]` (rank-major shards) -> `[s/cp, b, n, d]`."""
    cp = dist.get_world_size(group)
    s, b, n, d = x.shape
    parts = _a2a(x.reshape(cp, s // cp, b, n, d), group)  # [cp (head part), s/cp, b, n/cp, d]
    return parts.permute(1, 2, 0, 3, 4).reshape(s // cp, b, cp * n, d)


class SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad, ctx.group), None


class HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _head_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad, ctx.group), None


def _chunk_order(cp: int, device: torch.device) -> torch.Tensor:
    """Chunk index (of 2cp) of each rank-major gathered chunk: [0, 2cp-1, 1, 2cp-2, ...]."""
    return torch.tensor([c for r in range(cp) for c in (r, 2 * cp - 1 - r)], device=device)


def check_heads_divide(n: int, g: int, size: int, kind: str, fix: str) -> None:
    """An all-to-all over `size` ranks splits the n query heads and g groups of a tp rank
    into contiguous parts, so both must divide by it (raised before any collective)."""
    if n % size or g % size:
        raise ModelConfigError(
            f"cp_comm_type={kind!r} on {n} query heads / {g} groups per tp rank with an "
            f"all-to-all over {size} ranks: the rule: heads and query groups per tp rank "
            f"must divide by the all-to-all's size; fix: {fix}"
        )


def a2a_attention(
    q,
    k,
    v,
    scale: float,
    group: Any,
    attention_backend: str = "auto",
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """q `[s/cp, b, n, d]`, k/v `[s/cp, b, g, d]` -> out `[s/cp, b, n, d]` (causal; one
    SDPA call on `attention_backend`'s kernels). gpt-oss's variants: `sinks` `[n]` (this
    cp rank's contiguous n/cp of them apply to its heads) and a `window` of keys back over
    the whole sequence, which each rank sees in global order."""
    cp = dist.get_world_size(group)
    fix = "use cp_comm_type='p2p' or 'all_gather'"
    check_heads_divide(q.size(2), k.size(2), cp, "a2a", fix)
    q, k, v = (SeqToHead.apply(x, group) for x in (q, k, v))  # [s, b, ·/cp, d]
    s = q.size(0)
    order = _chunk_order(cp, q.device)  # gathered chunk i is global chunk order[i]
    inverse = torch.argsort(order)
    chunk = s // (2 * cp)
    perm = (inverse[:, None] * chunk + torch.arange(chunk, device=q.device)).reshape(-1)
    q, k, v = (x.index_select(0, perm).permute(1, 2, 0, 3) for x in (q, k, v))
    mine = None
    if sinks is not None:  # this cp rank's contiguous n/cp heads
        part = sinks.size(0) // cp
        mine = sinks[dist.get_rank(group) * part :][:part]
    out = variant_sdpa(
        q,
        k,
        v,
        sinks=mine,
        window=window,
        keep=None,
        dropout_p=0.0,
        scale=scale,
        attention_backend=attention_backend,
    )
    out = out.permute(2, 0, 1, 3)  # [s, b, n/cp, d] in global order
    back = torch.argsort(perm)
    return HeadToSeq.apply(out.index_select(0, back).contiguous(), group)
