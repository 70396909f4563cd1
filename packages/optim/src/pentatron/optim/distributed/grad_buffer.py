"""Contiguous param and grad buffers split into buckets, and each bucket's collectives.

Layout (Megatron's `_ParamAndGradBuffer`): params are laid out in reverse of
`module.parameters()` order, which approximates the order their grads become ready in
backward, so the first bucket fills first and its reduction can start earliest. A bucket is
closed once it holds `bucket_size` elements or more. With the distributed optimizer every
param starts on a 64-element boundary and every bucket is padded to a multiple of
lcm(dp, 128), so each dp rank owns an equal contiguous shard of each bucket.

Collectives, per bucket of `n` elements over a dp group of `d` ranks:
- all-reduce DDP: `grad[n]` -> all-reduce(dp) -> `grad[n]`;
- distributed optimizer: `grad[n]` -> reduce-scatter(dp) -> `grad[n/d]` (this rank's shard,
  written in place), and after the step `param[n/d]` -> all-gather(dp) -> `param[n]`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pentatron.parallel_state import comm

PARAM_ALIGN = 64
"""Distributed optimizer: params start on this element boundary (aligned shard copies)."""
BUCKET_ALIGN = 128
"""Distributed optimizer: buckets are padded to a multiple of lcm(dp, BUCKET_ALIGN)."""


@dataclass(frozen=True)
class BufferLayout:
    """Where each param and bucket lives in a buffer (element offsets, end exclusive)."""

    param_ranges: tuple[tuple[int, int], ...]  # per param, in buffer order
    bucket_ranges: tuple[tuple[int, int], ...]  # padded [start, end) of each bucket
    bucket_params: tuple[tuple[int, ...], ...]  # indices of the params of each bucket
    numel: int  # total, padding included


def plan_layout(
    numels: Sequence[int],
    bucket_size: int | None,
    dp_size: int,
    pad_for_sharding: bool,
    own_bucket: Sequence[bool] | None = None,
) -> BufferLayout:
    """Lay out params of `numels` (already in buffer order) into buckets.

    `own_bucket[i]` forces param i into a bucket of its own (the distributed optimizer does
    that for tied embeddings, so both pipeline stages holding them shard them alike).
    """
    own_bucket = own_bucket or [False] * len(numels)
    bucket_pad = math.lcm(dp_size, BUCKET_ALIGN) if pad_for_sharding else 1
    ranges: list[tuple[int, int]] = []
    buckets: list[tuple[int, int]] = []
    members: list[tuple[int, ...]] = []
    current: list[int] = []  # indices of the params of the open bucket
    bucket_start, offset = 0, 0

    def close() -> None:
        nonlocal bucket_start, offset, current
        if not current:
            return
        offset = _round_up(offset, bucket_pad)
        buckets.append((bucket_start, offset))
        members.append(tuple(current))
        bucket_start, current = offset, []

    for i, n in enumerate(numels):
        if own_bucket[i]:
            close()
        start = _round_up(offset, PARAM_ALIGN) if pad_for_sharding else offset
        ranges.append((start, start + n))
        offset = start + n
        current.append(i)
        if own_bucket[i] or (bucket_size is not None and offset - bucket_start >= bucket_size):
            close()
    close()
    return BufferLayout(tuple(ranges), tuple(buckets), tuple(members), offset)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(eq=False)
class Bucket:
    """A contiguous slice of a buffer whose grads are reduced by one collective."""

    index: int
    params: list[torch.nn.Parameter]
    start: int
    end: int
    grad_data: torch.Tensor
    param_data: torch.Tensor | None
    ready: set[int] = field(default_factory=set)
    grad_handle: Any = None
    grad_launched: bool = False
    param_handle: Any = None

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard(self, data: torch.Tensor, dp_size: int, dp_rank: int) -> torch.Tensor:
        """This rank's contiguous 1/dp of `data` (a view)."""
        return data.view(dp_size, -1)[dp_rank]


class ParamAndGradBuffer:
    """One dtype's params: a grad buffer (and, when sharded, a param buffer) with buckets.

    Each param gets `param.main_grad`, a view of the grad buffer where backward accumulates.
    With `use_distributed_optimizer` the params' storage moves into the param buffer too, so
    the all-gather after the step writes straight into the model.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        *,
        grad_dtype: torch.dtype,
        bucket_size: int | None,
        dp_group: Any,
        use_distributed_optimizer: bool,
        gradient_scaling_factor: float,
        reduce_op: Any = dist.ReduceOp.SUM,
        check_for_nan_in_grad: bool = False,
        own_bucket: Sequence[bool] | None = None,
        name: str = "dense",
    ) -> None:
        self.params = list(params)
        self.param_dtype = self.params[0].dtype
        self.grad_dtype = grad_dtype
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group)
        self.sharded = use_distributed_optimizer
        self.scaling = gradient_scaling_factor
        self.reduce_op = reduce_op
        self.check_for_nan = check_for_nan_in_grad
        self.name = name
        self.layout = plan_layout(
            [p.numel() for p in self.params], bucket_size, self.dp_size, self.sharded, own_bucket
        )
        device = self.params[0].device
        self.grad_data = torch.zeros(self.layout.numel, dtype=grad_dtype, device=device)
        self.param_data = None
        if self.sharded:
            self.param_data = torch.zeros(self.layout.numel, dtype=self.param_dtype, device=device)
        self.param_range: dict[torch.nn.Parameter, tuple[int, int]] = {}
        for param, (start, end) in zip(self.params, self.layout.param_ranges):
            self.param_range[param] = (start, end)
            if self.param_data is not None:
                view = self.param_data[start:end].view_as(param)
                view.copy_(param.data)
                param.data = view
            # torch stubs lack DDP's .main_grad
            param.main_grad = self.grad_data[start:end].view_as(param)  # type: ignore[attr-defined]
        self.buckets = [
            self._make_bucket(i, start, end, idx)
            for i, ((start, end), idx) in enumerate(
                zip(self.layout.bucket_ranges, self.layout.bucket_params)
            )
        ]
        self.param_to_bucket = {p: b for b in self.buckets for p in b.params}

    def _make_bucket(self, index: int, start: int, end: int, members: tuple[int, ...]) -> Bucket:
        params = [self.params[i] for i in members]
        param_data = None if self.param_data is None else self.param_data[start:end]
        return Bucket(index, params, start, end, self.grad_data[start:end], param_data)

    # --- grads -------------------------------------------------------------------------
    def register_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Called from param's backward hook in the last micro-batch: launch when full."""
        bucket = self.param_to_bucket[param]
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params) and not bucket.grad_launched:
            self.start_grad_sync(bucket, async_op=True)

    def start_grad_sync(self, bucket: Bucket, async_op: bool) -> None:
        if self.check_for_nan:
            self._check_finite(bucket)
        if self.scaling != 1.0:
            bucket.grad_data.mul_(self.scaling)
        if self.dp_size == 1:
            # A collective over one rank is the identity, but gloo still copies the whole
            # bucket (about a third of an AdamW step at dp=1 on CPU): skip it.
            handle = None
        elif self.sharded:
            shard = bucket.shard(bucket.grad_data, self.dp_size, self.dp_rank)
            handle = comm.reduce_scatter_tensor(
                shard, bucket.grad_data, op=self.reduce_op, group=self.dp_group, async_op=async_op
            )
        else:
            handle = comm.all_reduce(
                bucket.grad_data, op=self.reduce_op, group=self.dp_group, async_op=async_op
            )
        bucket.grad_handle, bucket.grad_launched = handle, True

    def finish_grad_sync(self) -> None:
        """Wait for every bucket's reduction; launch (blocking) those not started yet."""
        for bucket in self.buckets:  # the same order on every rank
            if not bucket.grad_launched:
                self.start_grad_sync(bucket, async_op=False)
            if bucket.grad_handle is not None:
                bucket.grad_handle.wait()
            bucket.grad_handle = None
        self.reset_grad_state()

    def reset_grad_state(self) -> None:
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.grad_launched = False
            bucket.grad_handle = None

    def _check_finite(self, bucket: Bucket) -> None:
        if not torch.isfinite(bucket.grad_data).all():
            bad = [
                i
                for i, p in enumerate(bucket.params)
                # torch stubs lack DDP's .main_grad
                if not torch.isfinite(p.main_grad).all()  # type: ignore[attr-defined]
            ]
            raise RuntimeError(
                f"rank {dist.get_rank()}: non-finite grad in {self.name} buffer bucket "
                f"{bucket.index} (params {bad} of the bucket, shapes "
                f"{[tuple(bucket.params[i].shape) for i in bad]}) before its reduction; "
                "check_for_nan_in_grad=True stops here so the bad rank is known"
            )

    def zero_grad(self) -> None:
        self.grad_data.zero_()
        self.reset_grad_state()

    def scale_gradients(self, factor: float | torch.Tensor) -> None:
        self.grad_data.mul_(factor)

    # --- params (distributed optimizer) ------------------------------------------------
    def grad_shard(self, bucket: Bucket) -> torch.Tensor:
        return bucket.shard(bucket.grad_data, self.dp_size, self.dp_rank)

    def param_shard(self, bucket: Bucket) -> torch.Tensor:
        assert bucket.param_data is not None, "param shards exist only when sharded"
        return bucket.shard(bucket.param_data, self.dp_size, self.dp_rank)

    def start_param_sync(self, async_op: bool) -> None:
        """`param[n/d]` -> all-gather(dp) -> `param[n]` for every bucket."""
        if self.dp_size == 1:  # the shard is the whole bucket already
            return
        for bucket in self.buckets:
            handle = comm.all_gather_into_tensor(
                bucket.param_data, self.param_shard(bucket), group=self.dp_group, async_op=async_op
            )
            bucket.param_handle = handle

    def finish_param_sync(self, bucket: Bucket | None = None) -> None:
        for b in [bucket] if bucket is not None else self.buckets:
            if b.param_handle is not None:
                b.param_handle.wait()
                b.param_handle = None
