"""Load-balanced sequence sharding for context parallelism (Megatron's causal layout).

The sequence is cut into `2 cp` equal chunks; cp rank r holds chunks r and `2 cp - 1 - r`
(concatenated), so under a causal mask every rank does the same attention work.

    x [..., s, ...] (dim) -> shard_for_cp_rank -> [..., s / cp, ...]   (no communication)
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import ModelConfigError

CP_BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def check_cp_seq_len(seq_len: int, cp_size: int, what: str = "sequence length") -> None:
    """Raise unless `seq_len` splits into `2 cp` equal chunks."""
    if cp_size > 1 and seq_len % (2 * cp_size):
        raise ModelConfigError(
            f"{what}={seq_len} with context_parallel_size={cp_size}: the rule: the sequence "
            f"is cut into 2*cp = {2 * cp_size} equal chunks (causal load balancing), so it "
            f"must be a multiple of {2 * cp_size}; fix: pad the sequence to a multiple of "
            f"{2 * cp_size} or change context_parallel_size"
        )


def cp_chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunk indices (of `2 cp`) held by `cp_rank`."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_positions(seq_len: int, cp_size: int, cp_rank: int, device: Any = None) -> torch.Tensor:
    """Global positions `[s / cp]` of the tokens held by `cp_rank` (int64)."""
    check_cp_seq_len(seq_len, cp_size)
    n = seq_len // (2 * cp_size)
    a, b = cp_chunk_ids(cp_size, cp_rank)
    idx = [torch.arange(a * n, (a + 1) * n), torch.arange(b * n, (b + 1) * n)]
    return torch.cat(idx).to(device)


def shard_for_cp_rank(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """`[..., s, ...]` -> this rank's `[..., s / cp, ...]` (chunks r and 2cp-1-r of `dim`)."""
    if cp_size == 1:
        return x
    check_cp_seq_len(x.size(dim), cp_size, f"size of dim {dim}")
    chunks = x.chunk(2 * cp_size, dim=dim)
    a, b = cp_chunk_ids(cp_size, cp_rank)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def gather_cp_shards(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_for_cp_rank`: every rank's shard (in cp rank order) -> `[.., s, ..]`."""
    cp = len(shards)
    if cp == 1:
        return shards[0]
    chunks: list[Any] = [None] * (2 * cp)
    for r, shard in enumerate(shards):
        first, second = shard.chunk(2, dim=dim)
        a, b = cp_chunk_ids(cp, r)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=dim)


def get_batch_on_this_cp_rank(
    batch: dict[str, torch.Tensor], cp_size: int, cp_rank: int
) -> dict[str, torch.Tensor]:
    """Shard tokens, labels, loss_mask, position_ids (`[b, s]`) to `[b, s / cp]`.

    position_ids keep their GLOBAL values (RoPE and learned positions read them); other keys
    pass through unchanged.
    """
    if cp_size == 1:
        return batch
    out = dict(batch)
    for key in CP_BATCH_KEYS:
        if out.get(key) is not None:
            out[key] = shard_for_cp_rank(out[key], cp_size, cp_rank, dim=1)
    return out
