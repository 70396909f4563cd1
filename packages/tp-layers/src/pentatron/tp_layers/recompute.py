"""Activation recomputation: run a block without saving its activations, redo it in backward.

`checkpoint(fn, *args)` runs `fn` under no_grad, keeping only its tensor inputs. In
backward it restores the CPU, CUDA and tracker RNG states captured before the forward,
re-runs `fn` with grad enabled, and back-propagates through that. Restoring the RNG is
what makes dropout draw the same masks the second time, so gradients equal those of the
plain forward exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .random import RNGStatesTracker, get_rng_tracker


def _capture(tracker: RNGStatesTracker) -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "tracker": tracker.get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore(state: dict[str, Any], tracker: RNGStatesTracker) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tracker.set_states(state["tracker"])


def _detached_inputs(args: list[Any]) -> list[Any]:
    """Fresh leaves for the recomputation, so grads stop at the block's boundary."""
    return [a.detach().requires_grad_(a.requires_grad) if torch.is_tensor(a) else a for a in args]


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Any], tracker: RNGStatesTracker, *args: Any) -> Any:
        ctx.fn, ctx.tracker = fn, tracker
        ctx.rng = _capture(tracker)
        ctx.tensor_at = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*[args[i] for i in ctx.tensor_at])
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_at, ctx.saved_tensors):
            args[i] = t
        inputs = _detached_inputs(args)
        after_forward = _capture(ctx.tracker)
        _restore(ctx.rng, ctx.tracker)
        try:
            with torch.enable_grad():
                outputs = ctx.fn(*inputs)
        finally:
            _restore(after_forward, ctx.tracker)  # the rest of backward must not notice
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [
            (o, g)
            for o, g in zip(outputs, grads)
            if torch.is_tensor(o) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = [a.grad if torch.is_tensor(a) else None for a in inputs]
        return (None, None, *input_grads)


def checkpoint(fn: Callable[..., Any], *args: Any, tracker: RNGStatesTracker | None = None) -> Any:
    """`fn(*args)`, recomputed in backward instead of storing its activations.

    RNG states (CPU, CUDA, and `tracker`'s named states, default the process-wide tracker)
    are replayed, so dropout inside `fn` matches. Non-tensor args are passed through.
    """
    return _CheckpointFunction.apply(fn, tracker or get_rng_tracker(), *args)
