"""Selective recomputation (`recompute_granularity="selective"`, `recompute_modules`).

Megatron-LM's module names and the two kinds of checkpoint they use:

    core_attn       core attention (SDPA)           checkpoint           attention.py
    mlp             a dense layer's MLP              checkpoint           transformer_layer.py
    moe             a MoE layer (router ... combine) checkpoint           moe/moe_layer.py
    shared_experts  a MoE layer's shared experts     checkpoint           moe/moe_layer.py
    layernorm       input and pre-MLP norms          output-discarding    transformer_layer.py
    moe_act         the routed experts' activation   output-discarding    moe/experts.py

`checkpoint` (tp-layers) keeps a block's inputs and re-runs it in its backward. Its output
is still kept by the next op that saves its input (linear_qkv keeps the normalised
hidden states), so a norm or an activation checkpointed that way saves nothing.
`CheckpointWithoutOutput` (Megatron's) also frees that output: after its consumer ran,
`discard_output_and_register_recompute(consumer_output)` releases the output's storage
(every view of it, saved or not, now holds no memory) and hooks the consumer output's
grad; when backward reaches it, before the consumer's own backward, the block is re-run
once with grad and its values are written back into the same storage, and the block's
backward then runs through that recomputed graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def selective(config: Any, name: str) -> bool:
    """Whether `config` recomputes module `name` (one of Megatron's recompute_modules)."""
    return config.recompute_granularity == "selective" and name in (config.recompute_modules or ())


def recompute_now(config: Any, name: str, training: bool) -> bool:
    """`selective(config, name)` in a training forward that records grads."""
    return training and torch.is_grad_enabled() and selective(config, name)


def _detached(args: list[Any]) -> list[Any]:
    return [a.detach().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a for a in args]


class _CheckpointWithoutOutputFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], owner: CheckpointWithoutOutput, *args: Any):
        with torch.no_grad():
            out = fn(*args)
        ctx.tensor_at = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[args[i] for i in ctx.tensor_at])
        ctx.owner = owner
        owner.ctx = ctx
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        owner = ctx.owner
        if owner.recomputed is None:  # the consumer's hook did not fire (or nothing hooked)
            owner.recompute()
        assert owner.recomputed is not None, "recompute() sets it"
        out, inputs = owner.recomputed
        owner.recomputed, ctx.owner = None, None
        torch.autograd.backward(out, grad)
        grads = [a.grad if torch.is_tensor(a) else None for a in inputs]
        return (None, None, *grads)


class CheckpointWithoutOutput:
    """One use: `y = ckpt.checkpoint(fn, *args)`; run the consumer `z = g(y)`;
    `ckpt.discard_output_and_register_recompute(z)`. `fn` returns one tensor, draws no
    random numbers (norms, activations) and is re-run once in backward; gradients equal
    those of `g(fn(*args))` exactly (the recomputed values are bitwise the forward's)."""

    def __init__(self) -> None:
        self.fn: Callable[..., Any] | None = None
        self.ctx: Any = None
        self.output: torch.Tensor | None = None
        self.nbytes = 0
        self.recomputed: tuple[torch.Tensor, list[Any]] | None = None

    def checkpoint(self, fn: Callable[..., Any], *args: Any) -> torch.Tensor:
        """`fn(*args)` run without grad, its tensor inputs kept for the recomputation."""
        self.fn = fn
        out = _CheckpointWithoutOutputFunction.apply(fn, self, *args)
        if not torch.is_tensor(out):
            raise TypeError(
                f"CheckpointWithoutOutput: fn returned {type(out).__name__}; the rule: one "
                "tensor (a norm's or an activation's output); fix: checkpoint such a function"
            )
        self.output = out
        return out

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the output's storage; recompute it when `hook_tensor`'s grad is computed.

        `hook_tensor` must be computed from the output, and every backward op that reads the
        output must run after its grad (the consumer's output: `linear_proj`'s for the
        input norm, the MLP's for the pre-MLP norm, `fc2`'s for the activation)."""
        out, ctx = self.output, self.ctx
        if out is None or ctx is None:
            return
        inputs = {t.untyped_storage().data_ptr() for t in ctx.saved_tensors}
        if out.untyped_storage().data_ptr() not in inputs:  # an output aliasing an input stays
            self.nbytes = out.untyped_storage().nbytes()
            out.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute_hook)

    def _recompute_hook(self, grad: torch.Tensor) -> None:
        if self.ctx is not None and self.recomputed is None:
            self.recompute()

    def recompute(self) -> None:
        """Re-run `fn` with grad on the saved inputs and put its values back in place."""
        ctx, out, fn = self.ctx, self.output, self.fn
        assert ctx is not None and out is not None and fn is not None, "checkpoint() ran"
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_at, ctx.saved_tensors):
            args[i] = t
        inputs = _detached(args)
        with torch.enable_grad():
            again = fn(*inputs)
        if self.nbytes:  # write the values back into the released storage, in place
            storage = out.untyped_storage()
            storage.resize_(self.nbytes)
            # a separate tensor on the same storage: the copy does not bump `out`'s version
            # counter, which the saved views of `out` are checked against
            alias = torch.empty(0, dtype=out.dtype, device=out.device)
            alias.set_(storage, out.storage_offset(), out.size(), out.stride())
            with torch.no_grad():
                alias.copy_(again)
            self.nbytes = 0
        self.recomputed = (again, inputs)
        self.ctx, self.output, self.fn = None, None, None
