"""Dispatch of causal core attention over the cp group by `cp_comm_type`.

q [s/cp, b, n, d], k/v [s/cp, b, g, d] (this rank's chunks r, 2cp-1-r) -> [s/cp, b, n d]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..config import ModelConfigError
from .a2a import a2a_attention
from .all_gather import all_gather_attention
from .ring import ring_attention
from .sharding import check_cp_seq_len


def check_cp_inputs(config: Any, group: Any, seq_local: int, attention_mask: Any, p: float):
    """Runtime rules of cp attention, raised before any collective."""
    cp = config.context_parallel_size
    if group is None:
        raise ModelConfigError(
            f"context_parallel_size={cp} but the attention has no cp group: the rule: cp "
            "attention communicates over the model's cp group; fix: build the model through "
            "GPTModel (it calls set_cp_group) or call DotProductAttention.set_cp_group(group)"
        )
    if attention_mask is not None:
        raise ModelConfigError(
            f"attention_mask given with context_parallel_size={cp}: the rule: cp attention "
            "builds the causal mask from the global chunk positions; fix: pass "
            "attention_mask=None (causal) or use context_parallel_size=1"
        )
    if p > 0:
        raise ModelConfigError(
            f"attention_dropout={p} with context_parallel_size={cp}: the rule: cp attention "
            "has no attention dropout; fix: set attention_dropout=0.0"
        )
    check_cp_seq_len(seq_local * cp, cp, "sequence length")


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    config: Any,
    group: Any,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence -> `[s/cp, b, n d]`.

    `sinks` `[n]` (this tp rank's heads) and `window` (keys back): gpt-oss's variants,
    which every kind carries."""
    s, b = q.shape[:2]
    kind = config.cp_comm_type
    if kind == "p2p":
        qb, kb, vb = (x.permute(1, 2, 0, 3) for x in (q, k, v))
        out = ring_attention(qb, kb, vb, scale, group, sinks, window)  # [b, n, s/cp, d]
    elif kind == "all_gather":
        cp_rank = dist.get_group_rank(group, dist.get_rank())
        out = all_gather_attention(q, k, v, scale, group, cp_rank, sinks, window)
    elif kind == "a2a":
        out = a2a_attention(
            q, k, v, scale, group, config.attention_backend, sinks=sinks, window=window
        )
        return out.reshape(s, b, -1)
    else:
        raise ModelConfigError(
            f"cp_comm_type={kind!r}: the rule: one of ('p2p', 'all_gather', 'a2a'); "
            "fix: set cp_comm_type to one of them"
        )
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)
