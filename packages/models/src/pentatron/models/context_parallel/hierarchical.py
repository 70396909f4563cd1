"""Hierarchical context parallelism (cp_comm_type="a2a+p2p", Megatron's and Transformer
Engine's): an all-to-all over the first level (a consecutive cp ranks, inside a node)
turns sequence shards into head shards, then the ring ("p2p") runs over the second level
(p = cp / a ranks) on a times longer chunks with n / a heads.

    q [s/cp, b, n, d] -> all-to-all(a2a group) -> [a s/cp, b, n/a, d], rank-major
      -> chunk reorder -> the ring's layout over p ranks -> ring attention(p2p group)
      -> inverse reorder -> all-to-all back -> [s/cp, b, n, d]

Why the reorder works: cp rank r = j a + i (j: its ring rank, i: its all-to-all rank)
holds chunks r and 2cp-1-r of 2cp. The a ranks of ring rank j together hold chunks
j a .. j a + a - 1 and 2cp - (j+1) a .. 2cp-1 - j a: super-chunks j and 2p-1-j of the
sequence cut into 2p, which is the ring's load-balanced layout at size p. The gathered
order (rank 0's two chunks, rank 1's, ...) becomes that layout by taking every rank's first
chunk in rank order, then every second chunk in reverse rank order (TE's
`get_seq_chunk_ids_for_reordering_before_attn`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .a2a import HeadToSeq, SeqToHead, check_heads_divide
from .ring import ring_attention


def _superchunk_order(a: int) -> list[int]:
    """Gathered chunk (of 2a, rank-major) at each position of the ring's layout."""
    return [2 * i for i in range(a)] + [2 * i + 1 for i in reversed(range(a))]


def _reorder(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """`[s, ...]` cut into len(order) chunks along dim 0, taken in `order`."""
    chunks = x.chunk(len(order), dim=0)
    return torch.cat([chunks[i] for i in order], dim=0)


def a2a_p2p_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    groups: list[Any],
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    fused: bool = True,
) -> torch.Tensor:
    """q `[s/cp, b, n, d]`, k/v `[s/cp, b, g, d]` (this cp rank's chunks), `groups`
    [all-to-all group, ring group] -> out `[s/cp, b, n, d]` (causal).

    `sinks` `[n]`: this all-to-all rank's contiguous n/a apply to its heads; `window`
    (keys back) masks by global positions, which the ring's layout keeps."""
    a2a_group, ring_group = groups
    a = dist.get_world_size(a2a_group)
    fix = "a smaller first entry of hierarchical_context_parallel_sizes, or cp_comm_type='p2p'"
    check_heads_divide(q.size(2), k.size(2), a, "a2a+p2p", fix)
    order = _superchunk_order(a)
    back = sorted(range(2 * a), key=order.__getitem__)
    q, k, v = (_reorder(SeqToHead.apply(x, a2a_group), order) for x in (q, k, v))
    mine = None
    if sinks is not None:
        part = sinks.size(0) // a
        mine = sinks[dist.get_rank(a2a_group) * part :][:part]
    qb, kb, vb = (x.permute(1, 2, 0, 3) for x in (q, k, v))  # [b, ·/a, a s/cp, d]
    out = ring_attention(qb, kb, vb, scale, ring_group, mine, window, fused)
    out = _reorder(out.permute(2, 0, 1, 3), back)  # [a s/cp, b, n/a, d], rank-major
    return HeadToSeq.apply(out.contiguous(), a2a_group)
