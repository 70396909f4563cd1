"""Dispatch of causal core attention over the cp group by `cp_comm_type` ("a2a+p2p": over
its two levels' groups).

q [s/cp, b, n, d], k/v [s/cp, b, g, d] (this rank's chunks r, 2cp-1-r) -> [s/cp, b, n d]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..config import ModelConfigError
from .a2a import a2a_attention
from .all_gather import all_gather_attention
from .block_kernels import fused_kernel
from .hierarchical import a2a_p2p_attention
from .ring import ring_attention
from .sharding import check_cp_seq_len


def check_cp_inputs(config: Any, group: Any, seq_local: int, attention_mask: Any, p: float):
    """Runtime rules of cp attention, raised before any collective."""
    cp = config.context_parallel_size
    if config.cp_comm_type == "a2a+p2p":
        _check_levels(config, group)
    elif group is None:
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


def _check_levels(config: Any, groups: Any) -> None:
    sizes = config.hierarchical_context_parallel_sizes
    got = None
    if isinstance(groups, (list, tuple)) and len(groups) == 2 and None not in groups:
        got = [dist.get_world_size(g) for g in groups]
    if got != list(sizes):
        raise ModelConfigError(
            f"cp_comm_type='a2a+p2p' with hierarchical_context_parallel_sizes={sizes} but the "
            f"attention's cp groups have sizes {got}: the rule: it communicates over the "
            "grid's two hierarchical cp groups, [all-to-all, ring], of those sizes; fix: "
            "build the grid with ParallelConfig(hierarchical_cp=(...)) of the same sizes and "
            "the model through GPTModel (or call DotProductAttention.set_cp_group(group, "
            "grid.hierarchical_cp_groups))"
        )


def blocks_fused(attention_backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Whether the p2p / all_gather blocks may run a fused kernel, by `attention_backend`
    (Megatron's --attention-backend): "unfused" and "local" ask for PyTorch's maths;
    "flash" insists on the flash kernel (raised here, before any collective, where the
    device and dtype have none: `block_kernels.fused_kernel`); "auto": where there is one.
    Windowed blocks take the maths whatever the backend (config_checks refuses "flash"
    with a window)."""
    if attention_backend in ("unfused", "local"):
        return False
    if attention_backend == "flash" and fused_kernel(q, k, v) is None:
        raise ModelConfigError(
            f"attention_backend='flash' with context parallelism: the rule: the blocks' flash "
            f"kernel needs bf16 / fp16 on a CUDA GPU of sm80+ (or the CPU, fp32 / bf16 / "
            f"fp16) and a head dim of at most 256, a multiple of 8; got {q.dtype} on "
            f"{q.device.type}, head dim {q.size(-1)}; fix: attention_backend='auto' (flash "
            "where it applies) or a dtype / device that has it"
        )
    return True


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

    `group`: the cp group; for "a2a+p2p" the list [all-to-all group, ring group].

    `sinks` `[n]` (this tp rank's heads) and `window` (keys back): gpt-oss's variants,
    which every kind carries."""
    s, b = q.shape[:2]
    kind = config.cp_comm_type
    if kind == "p2p":
        fused = blocks_fused(config.attention_backend, q, k, v)
        qb, kb, vb = (x.permute(1, 2, 0, 3) for x in (q, k, v))
        out = ring_attention(qb, kb, vb, scale, group, sinks, window, fused)  # [b, n, s/cp, d]
    elif kind == "all_gather":
        fused = blocks_fused(config.attention_backend, q, k, v)
        cp_rank = dist.get_group_rank(group, dist.get_rank())
        out = all_gather_attention(q, k, v, scale, group, cp_rank, sinks, window, fused)
    elif kind == "a2a":
        out = a2a_attention(
            q, k, v, scale, group, config.attention_backend, sinks=sinks, window=window
        )
        return out.reshape(s, b, -1)
    elif kind == "a2a+p2p":
        fused = blocks_fused(config.attention_backend, q, k, v)
        out = a2a_p2p_attention(q, k, v, scale, group, sinks, window, fused)
        return out.reshape(s, b, -1)
    else:
        raise ModelConfigError(
            f"cp_comm_type={kind!r}: the rule: one of ('p2p', 'all_gather', 'a2a', 'a2a+p2p'); "
            "fix: set cp_comm_type to one of them"
        )
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)
