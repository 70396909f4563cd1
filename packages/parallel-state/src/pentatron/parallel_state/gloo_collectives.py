"""Reduce-scatter, all-gather and all-reduce on gloo, built from gloo's all-to-all.

Why: on gloo (the CPU backend: tests, laptops) torch's reduce-scatter is an all-reduce of
the whole input followed by a copy of this rank's shard, its all-gather a ring of n-1
sequential steps, and its all-reduce several rounds; each round costs every rank's
transport thread several syscalls and thread wake-ups. Gloo's all-to-all is one round of
direct pairwise sends. Measured on 2 cores (`benchmarks/gloo_collectives.py`, table in
docs/performance.md), CPU time per call, 64 fp32 elements at world 8: reduce-scatter 3.62
-> 0.86 ms, all-gather 2.02 -> 0.80 ms, all-reduce 3.62 -> 1.49 ms. A training step issues
hundreds of them: the test suite's tiny GPT at world 8 steps ~12% faster on CPU.

The algorithms move the bytes of the ring ones (each rank sends (n-1)/n of a reduce-
scatter's input, (n-1) shards of an all-gather) and reduce in rank order: rank 0's part,
then rank 1's, ... (deterministic, and the same on every rank after an all-reduce).

Only called by `comm` for CPU tensors on a gloo group, outside torch.compile (which traces
torch's own collectives), with an op in `LOCAL_OPS`; everything else takes torch's path.
Each function takes torch's call form (`group=`, `async_op=` keywords) so `comm` issues it
as it issues torch's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

# op -> in-place `out <- op(out, part)`
LOCAL_OPS: dict[Any, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    ReduceOp.SUM: lambda out, part: out.add_(part),
    ReduceOp.MAX: lambda out, part: torch.maximum(out, part, out=out),
    ReduceOp.MIN: lambda out, part: torch.minimum(out, part, out=out),
}


def applies(tensor: torch.Tensor, group: Any, op: Any = ReduceOp.SUM) -> bool:
    """Whether `tensor` on `group` with `op` takes these algorithms (see the docstring)."""
    if not tensor.is_cpu or tensor.dtype == torch.bool or op not in LOCAL_OPS:
        return False
    if torch.compiler.is_compiling():
        return False
    # "gloo", or a mixed "cpu:gloo,cuda:nccl" whose CPU part is gloo
    return "gloo" in str(dist.get_backend(group))


def _check_sizes(
    op: str, big_name: str, big: torch.Tensor, small_name: str, small: torch.Tensor, n: int
) -> None:
    """Before any collective, as torch's own checks fail: `big` must hold n x `small`."""
    if big.numel() != n * small.numel() or big.dtype != small.dtype:
        raise ValueError(
            f"{op}: {big_name} ({big.numel()} x {big.dtype}) must have {n} (the group's size) "
            f"times the elements of {small_name} ({small.numel()} x {small.dtype}), same dtype"
        )


def _reduce_parts(output: torch.Tensor, received: torch.Tensor, n: int, op: Any) -> None:
    """`output` <- op over the n rank-major parts of `received`, in rank order."""
    parts = received.view(n, -1)
    flat = output.view(-1) if output.is_contiguous() else parts[0].clone()
    flat.copy_(parts[0])
    combine = LOCAL_OPS[op]
    for j in range(1, n):
        combine(flat, parts[j])
    if flat.data_ptr() != output.data_ptr():
        output.copy_(flat.view(output.shape))


class FinishingWork:
    """The handle of an all-to-all whose result is reduced (or copied) locally: `wait()`
    waits for the transfer, then runs `finish` once."""

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self._work = work
        self._finish: Callable[[], None] | None = finish

    def wait(self, timeout: Any = None) -> bool:
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        self._run_finish()
        return done

    def is_completed(self) -> bool:
        if not self._work.is_completed():
            return False
        self._run_finish()  # a caller that polls, then reads, reads the reduced result
        return True

    def _run_finish(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: Any, *, group: Any, async_op: bool
) -> Any:
    """`input` `[n * d0, ...]` -> this rank's reduced shard `[d0, ...]` in `output`."""
    n = dist.get_world_size(group)
    _check_sizes("reduce_scatter_tensor", "input", input, "output", output, n)
    input = input.contiguous()
    received = torch.empty_like(input)
    work = dist.all_to_all_single(received, input, group=group, async_op=async_op)

    def finish() -> None:
        _reduce_parts(output, received, n, op)

    if async_op:
        return FinishingWork(work, finish)
    finish()
    return None


def all_gather(output: torch.Tensor, input: torch.Tensor, *, group: Any, async_op: bool) -> Any:
    """`[n] x input` -> `output` `[n * d0, ...]`, rank-major."""
    n = dist.get_world_size(group)
    _check_sizes("all_gather_into_tensor", "output", output, "input", input, n)
    # every peer gets the same part: n copies of the input, one per destination
    sent = input.reshape(1, -1).expand(n, -1).contiguous()
    received = output.view(n, -1) if output.is_contiguous() else torch.empty_like(sent)
    work = dist.all_to_all_single(received, sent, group=group, async_op=async_op)
    if received.data_ptr() == output.data_ptr():
        return work if async_op else None

    def finish() -> None:
        output.copy_(received.view(output.shape))

    if async_op:
        return FinishingWork(work, finish)
    finish()
    return None


def all_reduce(tensor: torch.Tensor, op: Any, *, group: Any, async_op: bool = False) -> None:
    """In place, synchronous only: reduce-scatter then all-gather, both as above. (An async
    all-reduce keeps torch's path: its second half would be a collective issued inside
    `wait()`, whose order across groups the caller does not control.)"""
    if async_op:
        raise ValueError("gloo_collectives.all_reduce is synchronous: use torch's for async")
    n = dist.get_world_size(group)
    numel = tensor.numel()
    pad = (-numel) % n
    in_place = tensor.is_contiguous() and not pad
    # a view of `tensor` when it can be: it is read by the first half, written by the second
    work = tensor.view(-1) if in_place else torch.cat([tensor.reshape(-1), tensor.new_zeros(pad)])
    shard = work.new_empty(work.numel() // n)
    reduce_scatter(shard, work, op, group=group, async_op=False)
    all_gather(work, shard, group=group, async_op=False)
    if not in_place:
        tensor.copy_(work[:numel].view(tensor.shape))
