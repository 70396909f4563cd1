"""The matmul shared by the parallel linears, with its backward communication built in.

`linear_with_grad_accumulation_and_async_allreduce` computes `y = x W^T + b` and, in backward,
(1) starts the input-gradient collective asynchronously (all-reduce over tp, or the
reduce-scatter of sequence parallelism), (2) computes the weight gradient while that
collective is in flight, then (3) waits. On CUDA with NCCL the two overlap; on CPU with gloo
the same code runs and is exact, only the overlap is smaller.

Weight-gradient accumulation fusion: when enabled and the weight has a `main_grad` tensor
(set by a DDP wrapper, usually fp32), the weight gradient is accumulated straight into
`main_grad` in its dtype and `weight.grad` stays unset, which saves one gradient-sized
buffer and one addition per micro-batch. The GEMM runs in the activations' dtype (bf16 on
tensor cores) and sums in `main_grad`'s fp32 (`wgrad.accumulate_weight_grad`). Under
torch.compile the same accumulation runs as one opaque operator of the traced backward
(`weight_grad_into_main_grad`), so a compiled layer's `main_grad` is the eager one's.

Split backward: inside a `WeightGradStore.defer()` (zero-bubble pipeline schedules) the
backward computes only the input gradient and queues the weight and bias gradients, which
the schedule runs later (`weight_grad_store`).
"""

from __future__ import annotations

from typing import Any

import torch

from pentatron.parallel_state import comm

from ..utils import group_size
from .weight_grad_store import DeferredWeightGrad, deferring_store
from .wgrad import accumulate_weight_grad, placeholder_grad


def _gather_input(x: torch.Tensor, group: Any, async_op: bool) -> tuple[torch.Tensor, Any]:
    """`[s/t, b, h]` -> all-gather(tp) -> `[s, b, h]` (with the pending handle if async)."""
    x = x.contiguous()
    out = x.new_empty((group_size(group) * x.size(0), *x.shape[1:]))
    handle = comm.all_gather_into_tensor(out, x, group=group, async_op=async_op)
    return out, handle


def _start_dgrad_collective(
    grad_input: torch.Tensor, group: Any, sequence_parallel: bool, allreduce: bool
) -> tuple[torch.Tensor, Any]:
    """Launch the input-grad collective; return the tensor it fills and its handle."""
    if sequence_parallel:
        out = grad_input.new_empty((grad_input.size(0) // group_size(group), *grad_input.shape[1:]))
        handle = comm.reduce_scatter_tensor(out, grad_input, group=group, async_op=True)
        return out, handle
    if allreduce:
        return grad_input, comm.all_reduce(grad_input, group=group, async_op=True)
    return grad_input, None


def _weight_grad(
    weight: torch.Tensor,
    grad_2d: torch.Tensor,
    input_2d: torch.Tensor,
    fuse: bool,
    traced: bool = False,
) -> torch.Tensor | None:
    """`dW = dY^T X`, either returned or accumulated into `weight.main_grad` (in the
    operands' dtype on tensor cores, summed in main_grad's fp32: see `wgrad`); `traced`: in
    a backward torch.compile traces (the accumulation as one operator, below)."""
    if not fuse:
        return grad_2d.t().matmul(input_2d)
    if traced:
        return weight_grad_into_main_grad(weight, grad_2d, input_2d)
    # torch stubs lack DDP's .main_grad
    accumulate_weight_grad(weight.main_grad, grad_2d, input_2d)  # type: ignore[attr-defined]
    if hasattr(weight, "grad_added_to_main_grad"):
        # DDP hooks fire on a non-None grad; tell them it is already in main_grad.
        weight.grad_added_to_main_grad = True
        return placeholder_grad(weight)
    return None


@torch.library.custom_op("pentatron_tp_layers::weight_grad_into_main_grad", mutates_args=())
def weight_grad_into_main_grad(
    weight: torch.Tensor, grad_2d: torch.Tensor, input_2d: torch.Tensor
) -> torch.Tensor:
    """The fused weight gradient as a torch operator, for a backward that torch.compile
    traces: `weight.main_grad += grad_2d^T @ input_2d` with the eager kernel, the weight
    flagged for DDP's hook, and the placeholder gradient returned.

    A traced backward can neither write a tensor outside its graph nor set an attribute; an
    operator is opaque to the compiler and runs at run time on the parameter object itself,
    so it does what the eager backward does. Its placeholder output is handed to autograd,
    which keeps the call from being removed as dead code. Used only for a weight with a DDP
    wrapper's `grad_added_to_main_grad` (without it the fused path returns no gradient, and
    an operator without a used output would be dropped).
    """
    grad = _weight_grad(weight, grad_2d, input_2d, fuse=True)
    assert grad is not None  # the weight has grad_added_to_main_grad (see the docstring)
    return grad


@weight_grad_into_main_grad.register_fake
def _weight_grad_into_main_grad_fake(
    weight: torch.Tensor, grad_2d: torch.Tensor, input_2d: torch.Tensor
) -> torch.Tensor:
    return torch.empty_like(weight)


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """See the module docstring; the autograd form of the parallel linears' matmul."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gradient_accumulation_fusion: bool,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
        group: Any,
        regather_input: bool,
    ) -> torch.Tensor:
        sequence_parallel = sequence_parallel and group_size(group) > 1
        total = _gather_input(x, group, async_op=False)[0] if sequence_parallel else x
        # With regather_input only the s/t shard is kept for backward (Megatron's memory
        # saving) at the cost of one more all-gather there.
        ctx.save_for_backward(x if sequence_parallel and regather_input else total, weight)
        ctx.weight = weight  # the parameter object itself: `main_grad` lives on it
        ctx.bias = bias  # likewise, for a deferred W (weight_grad_store)
        ctx.use_bias = bias is not None
        ctx.fuse = gradient_accumulation_fusion and hasattr(weight, "main_grad")
        # Traced by torch.compile: fuse only where the operator can (DDP's flag, see
        # `weight_grad_into_main_grad`); otherwise dW is returned like an unfused layer's.
        ctx.traced = torch.compiler.is_compiling()
        ctx.fuse = ctx.fuse and (not ctx.traced or hasattr(weight, "grad_added_to_main_grad"))
        ctx.allreduce = allreduce_dgrad and group_size(group) > 1
        ctx.sequence_parallel, ctx.regather, ctx.group = sequence_parallel, regather_input, group
        out = torch.matmul(total, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        saved_input, weight = ctx.saved_tensors
        store = deferring_store()
        if store is not None and (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]):
            store.push(_deferred_weight_grad(ctx, saved_input, grad_out))
            return _input_grad_only(ctx, grad_out, weight)
        total, handle = saved_input, None
        if ctx.sequence_parallel and ctx.regather:
            total, handle = _gather_input(saved_input, ctx.group, async_op=True)
        grad_in, dgrad_handle = None, None
        if ctx.needs_input_grad[0]:
            grad_in = grad_out.matmul(weight)
        if handle is not None:
            handle.wait()
        if grad_in is not None:
            grad_in, dgrad_handle = _start_dgrad_collective(
                grad_in.contiguous(), ctx.group, ctx.sequence_parallel, ctx.allreduce
            )
        grad_2d = grad_out.reshape(-1, grad_out.size(-1))
        grad_w = None
        if ctx.needs_input_grad[1]:
            input_2d = total.reshape(-1, total.size(-1))
            grad_w = _weight_grad(ctx.weight, grad_2d, input_2d, ctx.fuse, ctx.traced)
        grad_b = grad_2d.sum(dim=0) if ctx.use_bias and ctx.needs_input_grad[2] else None
        if dgrad_handle is not None:
            dgrad_handle.wait()
        return grad_in, grad_w, grad_b, None, None, None, None, None


def _input_grad_only(ctx: Any, grad_out: torch.Tensor, weight: torch.Tensor) -> tuple[Any, ...]:
    """B of a split backward: the input gradient and its collective; W is queued."""
    grad_in = None
    if ctx.needs_input_grad[0]:
        grad_in, handle = _start_dgrad_collective(
            grad_out.matmul(weight).contiguous(), ctx.group, ctx.sequence_parallel, ctx.allreduce
        )
        if handle is not None:
            handle.wait()
    return grad_in, None, None, None, None, None, None, None


def _deferred_weight_grad(
    ctx: Any, saved_input: torch.Tensor, grad_out: torch.Tensor
) -> DeferredWeightGrad:
    """W of a split backward: `dW = dY^T X` (fused into main_grad as in an undivided
    backward) and `db = sum dY`, handed to autograd on the params when the schedule runs it.
    Keeps `saved_input` (the s/t shard with regather) and `grad_out` `[s, b, o]`."""
    weight, bias, fuse = ctx.weight, ctx.bias, ctx.fuse
    want_w, want_b = ctx.needs_input_grad[1], ctx.use_bias and ctx.needs_input_grad[2]
    regather, group = ctx.sequence_parallel and ctx.regather, ctx.group

    def compute() -> list[tuple[torch.Tensor, torch.Tensor]]:
        grad_2d = grad_out.reshape(-1, grad_out.size(-1))
        pairs = []
        if want_w:
            total = (
                _gather_input(saved_input, group, async_op=False)[0] if regather else saved_input
            )
            grad_w = _weight_grad(weight, grad_2d, total.reshape(-1, total.size(-1)), fuse)
            if grad_w is not None:
                pairs.append((weight, grad_w))
        if want_b:
            pairs.append((bias, grad_2d.sum(dim=0)))
        return pairs

    nbytes = sum(t.numel() * t.element_size() for t in (saved_input, grad_out))
    return DeferredWeightGrad(compute, nbytes)


def linear_with_grad_accumulation_and_async_allreduce(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    tp_group: Any,
    regather_input: bool = True,
) -> torch.Tensor:
    """`[s/t or s, b, i]` -> (all-gather(tp) if sequence_parallel) -> `x W^T + b` -> `[s, b, o]`.

    Backward: input grad all-reduced over tp (`allreduce_dgrad`) or reduce-scattered back to
    `[s/t, b, i]` (`sequence_parallel`), overlapped with the weight-grad GEMM.
    """
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        x,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        tp_group,
        regather_input,
    )
