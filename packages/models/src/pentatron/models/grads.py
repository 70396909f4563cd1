"""Gradient all-reduces a GPT needs after backward, for users without pentatron.optim.

- parameters marked `sequence_parallel=True` (norms under SP, q/k norms at tp > 1, the
  biases of row-parallel layers under SP) hold tp-partial grads: all-reduce(tp);
- tied embedding copies (`shared_embedding=True`, first and last pipeline stage):
  all-reduce(embedding group), so both copies get the full grad and stay identical.
pentatron.optim's `finalize_model_grads` finds the same attributes and does the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pentatron.parallel_state import comm
from pentatron.tp_layers import sync_sequence_parallel_grads


def _grad(p: torch.nn.Parameter) -> torch.Tensor | None:
    return p.main_grad if hasattr(p, "main_grad") else p.grad


def allreduce_tied_embedding_grads(model_chunks: Sequence[torch.nn.Module], group: Any) -> int:
    """All-reduce the grads of `shared_embedding` params over `group`; returns their count."""
    grads = [
        g
        for chunk in model_chunks
        for p in chunk.parameters()
        if getattr(p, "shared_embedding", False) and (g := _grad(p)) is not None
    ]
    if group is not None and torch.distributed.is_initialized():
        for g in grads:
            comm.all_reduce(g, group=group)
    return len(grads)


def allreduce_expert_tp_partial_grads(module: torch.nn.Module, group: Any) -> int:
    """All-reduce(etp) the grads of `expert_tp_partial` params (a missing grad counts 0)."""
    params = [p for p in module.parameters() if getattr(p, "expert_tp_partial", False)]
    if group is None or not torch.distributed.is_initialized():
        return 0
    for p in params:
        if _grad(p) is None:
            p.grad = torch.zeros_like(p)
        comm.all_reduce(_grad(p), group=group)
    return len(params)


def sync_grads(model_chunks: Any, grid: Any = None) -> None:
    """After backward: all-reduce(tp) partial grads, then all-reduce tied embeddings.

    `model_chunks`: a GPTModel or this rank's list of chunks. Groups come from each
    chunk's grid (`chunk.parallel`); a single process does nothing.
    """
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    par = chunks[0].parallel
    if par.grid is None and grid is None:
        return
    for chunk in chunks:
        sync_sequence_parallel_grads(chunk, chunk.parallel.tp_group)
        if chunk.config.is_moe and chunk.parallel.etp_size > 1:
            allreduce_expert_tp_partial_grads(chunk, chunk.parallel.group("etp"))
    allreduce_tied_embedding_grads(chunks, par.embedding_group())
