"""`finalize_model_grads`: everything between the last backward and the optimizer step.

Order (Megatron's `finalize_model_grads`): wait for the data-parallel reductions of every
model chunk; all-reduce over tp the grads of params used on a sequence-parallel region
(norm weights: each tp rank saw s/t of the sequence); all-reduce over the embedding group
the grads of tied input/output embeddings (first and last pipeline stage each hold a
copy); then any model hooks (MoE router state such as expert-bias load counts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from pentatron.parallel_state import ProcessGrid, comm, get_default_grid

from .ddp import DistributedDataParallel
from .fsdp import local_tensor


def _main_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """DDP's main_grad, else `.grad`; of an FSDP2 param its local shard (the shards of a
    replicated or tied param are cut the same way on every rank of the reduced group)."""
    grad = getattr(param, "main_grad", None)
    grad = grad if grad is not None else param.grad
    return None if grad is None else local_tensor(grad)


def allreduce_grads(params: Iterable[torch.nn.Parameter], group: Any) -> int:
    """Sum the grads of `params` over `group` with one all-reduce per dtype; returns calls."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        grad = _main_grad(p)
        if grad is not None:
            by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(by_dtype)


def _chunk_params(chunks: Sequence[torch.nn.Module], attr: str) -> list[torch.nn.Parameter]:
    return [
        p
        for chunk in chunks
        for p in chunk.parameters()
        if p.requires_grad and getattr(p, attr, False)
    ]


def finalize_model_grads(
    model_chunks: Sequence[torch.nn.Module],
    *,
    grid: ProcessGrid | None = None,
    tp_group: Any = None,
    embedding_group: Any = None,
    hooks: Sequence[Callable[[], None]] = (),
) -> None:
    """Finish dp reductions, then the tp and embedding-group all-reduces, then `hooks`.

    Params are found by attribute: `sequence_parallel=True` (grad all-reduced over tp) and
    `shared_embedding=True` (all-reduced over the embedding group, on ranks that are in it).
    Groups default to `grid.group("tp")` / `grid.group("embedding")` of `grid` or the
    default grid.
    """
    for chunk in model_chunks:
        if isinstance(chunk, DistributedDataParallel):
            chunk.finish_grad_sync()
    sp_params = _chunk_params(model_chunks, "sequence_parallel")
    tied = _chunk_params(model_chunks, "shared_embedding")
    if (sp_params and tp_group is None) or (tied and embedding_group is None):
        grid = grid or get_default_grid()
        tp_group = tp_group if tp_group is not None else grid.group("tp")
        if embedding_group is None and grid.in_embedding_group():
            embedding_group = grid.group("embedding")
    if sp_params:
        allreduce_grads(sp_params, tp_group)
    if tied and embedding_group is not None:
        allreduce_grads(tied, embedding_group)
    for hook in hooks:
        hook()
