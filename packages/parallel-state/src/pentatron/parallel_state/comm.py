"""Collectives that name their group, fail with that name on timeout, and can be traced.

Inside `with trace() as ledger:` every call records (op, group name, dtype, elements,
bytes, wire_bytes) into `ledger`. `bytes` is the payload this rank hands the collective;
`wire_bytes` is what this rank sends under the ring / pairwise algorithms (all-reduce
2(n-1)/n, all-gather (n-1) x its shard, reduce-scatter (n-1)/n, all-to-all the parts sent
to other ranks, broadcast the payload on the root), so later packages can prove that, for
example, reduce-scatter + all-gather moves the bytes of one all-reduce.
Outside `trace()` the only cost is one list test.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from . import gloo_collectives

ReduceOp = dist.ReduceOp


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names its group and ranks."""


_GROUP_NAMES: dict[Any, str] = {}


def register_group_name(group: Any, name: str) -> None:
    _GROUP_NAMES[group] = name


def forget_group(group: Any) -> None:
    _GROUP_NAMES.pop(group, None)


def group_name(group: Any) -> str:
    if group is None or group is dist.group.WORLD:
        return "world"
    name = _GROUP_NAMES.get(group)
    if name is None:
        name = f"ranks{dist.get_process_group_ranks(group)}"
    return name


@dataclass(frozen=True)
class CommRecord:
    op: str
    group: str
    dtype: torch.dtype
    elements: int
    bytes: int
    wire_bytes: int


@dataclass
class Ledger:
    records: list[CommRecord] = field(default_factory=list)

    def totals(self) -> dict[str, dict[str, int]]:
        """Per group: number of calls, payload bytes and wire bytes."""
        out: dict[str, dict[str, int]] = defaultdict(
            lambda: {"calls": 0, "bytes": 0, "wire_bytes": 0}
        )
        for r in self.records:
            entry = out[r.group]
            entry["calls"] += 1
            entry["bytes"] += r.bytes
            entry["wire_bytes"] += r.wire_bytes
        return dict(out)

    def by_op(self) -> dict[tuple[str, str], int]:
        """Number of calls for each (op, group)."""
        out: dict[tuple[str, str], int] = defaultdict(int)
        for r in self.records:
            out[(r.op, r.group)] += 1
        return dict(out)

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.records)

    @property
    def total_wire_bytes(self) -> int:
        return sum(r.wire_bytes for r in self.records)


_ACTIVE: list[Ledger] = []


@contextlib.contextmanager
def trace() -> Iterator[Ledger]:
    """Record every collective issued through this module while the block runs."""
    ledger = Ledger()
    _ACTIVE.append(ledger)
    try:
        yield ledger
    finally:
        _ACTIVE.remove(ledger)


# torch 2.13 renamed the tensor forms (*_into_tensor / *_tensor -> *_single) and warns on
# the old names; older releases only have the old ones.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _size(group: Any) -> int:
    return dist.get_world_size(group)


def _record(op: str, group: Any, tensor: torch.Tensor, elements: int, wire_elements: float) -> None:
    item = tensor.element_size()
    rec = CommRecord(
        op,
        group_name(group),
        tensor.dtype,
        elements,
        elements * item,
        round(wire_elements * item),
    )
    for ledger in _ACTIVE:
        ledger.records.append(rec)


class _NamedWork:
    """An async handle whose wait() reports the group on failure."""

    def __init__(self, work: Any, op: str, group: Any) -> None:
        self._work, self._op, self._group = work, op, group

    def wait(self, timeout: Any = None) -> bool:
        with _named_errors(self._op, self._group):
            return self._work.wait() if timeout is None else self._work.wait(timeout)

    def is_completed(self) -> bool:
        return self._work.is_completed()


@contextlib.contextmanager
def _named_errors(op: str, group: Any) -> Iterator[None]:
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:  # gloo/nccl raise RuntimeError subclasses (incl. timeouts)
        try:
            ranks = dist.get_process_group_ranks(group) if group is not None else "all"
        except (RuntimeError, ValueError):
            ranks = "?"
        raise CollectiveError(
            f"{op} over group '{group_name(group)}' (global ranks {ranks}) on rank "
            f"{dist.get_rank()} did not complete: {exc}. A rank of that group did not take "
            "part (it failed, exited, or issued a different collective)."
        ) from exc


class _CompletedWork:
    """The handle of a collective issued synchronously (see `_call`): already complete."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_COMPLETED = _CompletedWork()


def _call(name: str, group: Any, async_op: bool, fn: Any, *args: Any, **kw: Any) -> Any:
    if async_op and torch.compiler.is_compiling():
        # torch.compile traces only synchronous collectives (into functional collectives,
        # whose waits the compiler places); the caller's handle is then already complete.
        fn(*args, group=group, async_op=False, **kw)
        return _COMPLETED
    with _named_errors(name, group):
        work = fn(*args, group=group, async_op=async_op, **kw)
    return _NamedWork(work, name, group) if async_op else None


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    """In place: `tensor` <- reduction over `group`."""
    if _ACTIVE:
        n = _size(group)
        _record("all_reduce", group, tensor, tensor.numel(), 2 * (n - 1) / n * tensor.numel())
    if not async_op and gloo_collectives.applies(tensor, group, op):
        return _call("all_reduce", group, False, gloo_collectives.all_reduce, tensor, op=op)
    return _call("all_reduce", group, async_op, dist.all_reduce, tensor, op=op)


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """`[n] x input` -> `output` of n times input's elements, rank-major along dim 0.

    `output` must be `[n * d0, ...]`: gloo rejects a stacked `[n, d0, ...]` output.
    """
    if _ACTIVE:
        n = _size(group)
        _record("all_gather", group, input, input.numel(), (n - 1) * input.numel())
    if gloo_collectives.applies(input, group):
        return _call("all_gather", group, async_op, gloo_collectives.all_gather, output, input)
    return _call("all_gather", group, async_op, _ALL_GATHER_SINGLE, output, input)


def all_gather(
    outputs: list[torch.Tensor], input: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    if _ACTIVE:
        n = _size(group)
        _record("all_gather", group, input, input.numel(), (n - 1) * input.numel())
    return _call("all_gather", group, async_op, dist.all_gather, outputs, input)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """`input` (n shards along dim 0) -> this rank's reduced shard in `output`."""
    if _ACTIVE:
        n = _size(group)
        _record("reduce_scatter", group, input, input.numel(), (n - 1) / n * input.numel())
    if gloo_collectives.applies(input, group, op):
        fn = gloo_collectives.reduce_scatter
        return _call("reduce_scatter", group, async_op, fn, output, input, op=op)
    return _call("reduce_scatter", group, async_op, _REDUCE_SCATTER_SINGLE, output, input, op=op)


def reduce_scatter(
    output: torch.Tensor,
    inputs: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    if _ACTIVE:
        n = _size(group)
        total = sum(t.numel() for t in inputs)
        _record("reduce_scatter", group, output, total, (n - 1) / n * total)
    return _call("reduce_scatter", group, async_op, dist.reduce_scatter, output, inputs, op=op)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """Rank i's j-th input part (dim 0) lands as rank j's i-th output part."""
    if _ACTIVE:
        n = _size(group)
        row = input[0].numel() if input.dim() else 1
        me = dist.get_group_rank(group, dist.get_rank()) if group is not None else dist.get_rank()
        sent: float
        if input_split_sizes:
            sent = (sum(input_split_sizes) - input_split_sizes[me]) * row
        else:
            sent = (n - 1) / n * input.numel()
        _record("all_to_all", group, input, input.numel(), sent)
    return _call(
        "all_to_all",
        group,
        async_op,
        dist.all_to_all_single,
        output,
        input,
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
    )


def all_to_all(
    outputs: list[torch.Tensor],
    inputs: list[torch.Tensor],
    group: Any = None,
    async_op: bool = False,
) -> Any:
    if _ACTIVE:
        me = dist.get_group_rank(group, dist.get_rank()) if group is not None else dist.get_rank()
        total = sum(t.numel() for t in inputs)
        _record("all_to_all", group, inputs[0], total, total - inputs[me].numel())
    return _call("all_to_all", group, async_op, dist.all_to_all, outputs, inputs)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    """`src` is a global rank, as in torch.distributed."""
    if _ACTIVE:
        sent = tensor.numel() if dist.get_rank() == src else 0
        _record("broadcast", group, tensor, tensor.numel(), sent)
    return _call("broadcast", group, async_op, dist.broadcast, tensor, src=src)


def send(tensor: torch.Tensor, dst: int, group: Any = None) -> None:
    """Blocking send to global rank `dst`."""
    if _ACTIVE:
        _record("send", group, tensor, tensor.numel(), tensor.numel())
    with _named_errors("send", group):
        dist.send(tensor, dst, group=group)


def recv(tensor: torch.Tensor, src: int, group: Any = None) -> None:
    """Blocking receive from global rank `src` into `tensor`."""
    if _ACTIVE:
        _record("recv", group, tensor, tensor.numel(), 0)
    with _named_errors("recv", group):
        dist.recv(tensor, src, group=group)


def isend(tensor: torch.Tensor, dst: int, group: Any = None) -> _NamedWork:
    if _ACTIVE:
        _record("send", group, tensor, tensor.numel(), tensor.numel())
    with _named_errors("isend", group):
        return _NamedWork(dist.isend(tensor, dst, group=group), "isend", group)


def irecv(tensor: torch.Tensor, src: int, group: Any = None) -> _NamedWork:
    if _ACTIVE:
        _record("recv", group, tensor, tensor.numel(), 0)
    with _named_errors("irecv", group):
        return _NamedWork(dist.irecv(tensor, src, group=group), "irecv", group)


@dataclass(frozen=True)
class P2POp:
    """One send or receive of a batch: `op` is "send" or "recv", `peer` a global rank."""

    op: str
    tensor: torch.Tensor
    peer: int
    group: Any = None


def batch_isend_irecv(ops: Sequence[P2POp]) -> list[_NamedWork]:
    """Start all sends and receives of `ops` together (torch's batch_isend_irecv)."""
    if not ops:
        return []
    torch_ops = []
    for p in ops:
        if p.op not in ("send", "recv"):
            raise ValueError(f"P2POp.op={p.op!r}: must be 'send' or 'recv'")
        if _ACTIVE:
            _record(
                p.op, p.group, p.tensor, p.tensor.numel(), p.tensor.numel() if p.op == "send" else 0
            )
        fn = dist.isend if p.op == "send" else dist.irecv
        torch_ops.append(dist.P2POp(fn, p.tensor, p.peer, group=p.group))
    group = ops[0].group
    with _named_errors("batch_isend_irecv", group):
        works = dist.batch_isend_irecv(torch_ops)
    return [_NamedWork(w, "batch_isend_irecv", group) for w in works]


def barrier(group: Any = None) -> None:
    with _named_errors("barrier", group):
        dist.barrier(group=group)
