"""Communication in and out of tensor- and sequence-parallel regions, as autograd functions.

Each mapping is a pair of collectives, one forward and its adjoint backward, over the group
it is given (`tp_group`: a ProcessGroup, DeviceMesh dim, or None for the default grid):

| function                                   | forward                    | backward            |
|--------------------------------------------|----------------------------|---------------------|
| copy_to_tensor_model_parallel_region (f)   | identity                   | all-reduce          |
| reduce_from_tensor_model_parallel_region (g)| all-reduce                | identity            |
| scatter_to_tensor_model_parallel_region    | split last dim             | all-gather last dim |
| gather_from_tensor_model_parallel_region   | all-gather last dim        | split last dim      |
| scatter_to_sequence_parallel_region        | split dim 0                | all-gather dim 0    |
| gather_from_sequence_parallel_region       | all-gather dim 0           | reduce-scatter dim 0 (or split) |
| reduce_scatter_to_sequence_parallel_region | reduce-scatter dim 0       | all-gather dim 0    |
| all_to_all                                 | all-to-all dim 0           | all-to-all, splits swapped |

Every collective goes through `pentatron.parallel_state.comm`, so `comm.trace()` counts it.
With a group of one rank every mapping is the identity and issues nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pentatron.parallel_state import comm

from .utils import TPConfigError, group_rank, group_size, resolve_group

# --- the collectives themselves (no autograd) ---------------------------------------------


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """`x` summed over `group`; a new tensor, because the caller's may be shared."""
    if group_size(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, group=group)
    return out


def _split_last_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.size(-1) % n:
        raise TPConfigError(
            f"last dim {x.size(-1)} is not divisible by the tensor-parallel size {n}; the "
            "rule: scatter_to_tensor_model_parallel_region splits it into equal shards; fix: "
            f"make it a multiple of {n}"
        )
    return x.chunk(n, dim=-1)[group_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    """`[..., h/n]` on each rank -> `[..., h]` (rank-major along the last dim)."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = _gather_first_dim(x.unsqueeze(0), group)  # [n, ..., h/n], gloo wants dim-0 concat
    return out.movedim(0, -2).reshape(*x.shape[:-1], n * x.shape[-1])


def _check_first_dim(x: torch.Tensor, n: int, what: str) -> None:
    if x.dim() == 0 or x.size(0) % n:
        size = x.size(0) if x.dim() else "a 0-d tensor"
        raise TPConfigError(
            f"sequence dim (dim 0) of size {size} is not divisible by the tensor-parallel size "
            f"{n}; the rule: {what} gives each rank s/{n} of the sequence; fix: pad the "
            f"sequence length to a multiple of {n}"
        )


def _split_first_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    _check_first_dim(x, n, "sequence parallelism")
    return x.chunk(n, dim=0)[group_rank(group)].contiguous()


def _gather_first_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    """`[s/n, ...]` on each rank -> `[s, ...]`."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((n * x.size(0), *x.shape[1:]))
    comm.all_gather_into_tensor(out, x, group=group)
    return out


def _reduce_scatter_first_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    """`[s, ...]` partial sums on each rank -> this rank's `[s/n, ...]` of the total."""
    n = group_size(group)
    if n == 1:
        return x
    _check_first_dim(x, n, "reduce-scatter to the sequence-parallel region")
    x = x.contiguous()
    out = x.new_empty((x.size(0) // n, *x.shape[1:]))
    comm.reduce_scatter_tensor(out, x, group=group)
    return out


def _all_to_all(
    x: torch.Tensor,
    group: Any,
    output_split_sizes: Sequence[int] | None,
    input_split_sizes: Sequence[int] | None,
) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    rows = x.size(0) if output_split_sizes is None else sum(output_split_sizes)
    out = x.new_empty((rows, *x.shape[1:]))
    comm.all_to_all_single(
        out,
        x,
        output_split_sizes=list(output_split_sizes) if output_split_sizes else None,
        input_split_sizes=list(input_split_sizes) if input_split_sizes else None,
        group=group,
    )
    return out


# --- autograd functions --------------------------------------------------------------------


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last_dim(grad, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _split_first_dim(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_first_dim(grad, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, tp_output_grad: bool) -> torch.Tensor:
        ctx.group, ctx.tp_output_grad = group, tp_output_grad
        return _gather_first_dim(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # A tensor-parallel consumer leaves a partial grad on each rank (sum them); a
        # replicated consumer leaves the full grad on each rank (just take our slice).
        if ctx.tp_output_grad:
            return _reduce_scatter_first_dim(grad, ctx.group), None, None
        return _split_first_dim(grad, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_first_dim(grad, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, out_splits: Any, in_splits: Any) -> Any:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return _all_to_all(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # The adjoint of a permutation of rows is the inverse permutation: swap the splits.
        return _all_to_all(grad, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


# --- public API ----------------------------------------------------------------------------


def copy_to_tensor_model_parallel_region(x: torch.Tensor, tp_group: Any = None) -> torch.Tensor:
    """f: `[*, h]` -> identity -> `[*, h]`; backward all-reduce(tp) of the grad."""
    return _CopyToRegion.apply(x, resolve_group(tp_group))


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, tp_group: Any = None) -> torch.Tensor:
    """g: `[*, h]` partial sums -> all-reduce(tp) -> `[*, h]`; backward identity."""
    return _ReduceFromRegion.apply(x, resolve_group(tp_group))


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, tp_group: Any = None) -> torch.Tensor:
    """`[*, h]` -> this rank's slice `[*, h/t]`; backward all-gather(tp) along the last dim."""
    return _ScatterToRegion.apply(x, resolve_group(tp_group))


def gather_from_tensor_model_parallel_region(x: torch.Tensor, tp_group: Any = None) -> torch.Tensor:
    """`[*, h/t]` -> all-gather(tp) along the last dim -> `[*, h]`; backward split."""
    return _GatherFromRegion.apply(x, resolve_group(tp_group))


def scatter_to_sequence_parallel_region(x: torch.Tensor, tp_group: Any = None) -> torch.Tensor:
    """`[s, b, h]` -> this rank's `[s/t, b, h]`; backward all-gather(tp) along dim 0."""
    return _ScatterToSequenceRegion.apply(x, resolve_group(tp_group))


def gather_from_sequence_parallel_region(
    x: torch.Tensor, tp_group: Any = None, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """`[s/t, b, h]` -> all-gather(tp) -> `[s, b, h]`.

    Backward: reduce-scatter(tp) of the grad when the consumer is tensor-parallel (each rank
    holds a partial grad, e.g. a column-parallel linear), else a split
    (`tensor_parallel_output_grad=False`: the consumer is replicated, the grad is complete).
    """
    return _GatherFromSequenceRegion.apply(x, resolve_group(tp_group), tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, tp_group: Any = None
) -> torch.Tensor:
    """`[s, b, h]` partial sums -> reduce-scatter(tp) -> `[s/t, b, h]`; backward all-gather."""
    return _ReduceScatterToSequenceRegion.apply(x, resolve_group(tp_group))


def all_to_all(
    x: torch.Tensor,
    group: Any = None,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """`[n_in, *]` -> all-to-all(group) along dim 0 -> `[sum(output_split_sizes), *]`.

    Rank i's j-th part (`input_split_sizes[j]` rows) becomes rank j's i-th part. Without
    splits every rank sends n_in/world rows to each rank. Backward: the inverse all-to-all.
    """
    return _AllToAll.apply(x, resolve_group(group), output_split_sizes, input_split_sizes)
