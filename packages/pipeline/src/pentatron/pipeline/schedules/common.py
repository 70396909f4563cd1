"""Pieces every schedule shares: one forward step, one backward step, pseudo-freeing,
the no_sync switch, and the argument checks done before any communication.

Calling convention (Megatron-LM's): `forward_step_func(data_iterator, model_chunk)` returns
`(output_tensor, loss_func)`; on the last stage `loss_func(output_tensor)` returns either
`(loss, reduced)` (loss is divided by m) or `(loss, num_tokens, reduced)` (divided by
num_tokens and m, or left summed in per-token mode, where the step's token total is handed
to finalize_model_grads_func). `reduced` is appended to the list the schedule returns.
Model chunks receive their input through `chunk.set_input_tensor([tensor or None])`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.variable import Variable

from pentatron.parallel_state import current_device

from ..config import PipelineConfig, PipelineConfigError
from ..timeline import Timeline


def deallocate_output_tensor(out: torch.Tensor | None, enabled: bool) -> None:
    """Pseudo-free a sent output: keep its grad_fn, drop its data (a 1-element tensor).

    Once the next stage holds the activation, this stage needs only the autograd graph
    behind it, so its `[s, b, h]` storage can go back to the allocator.
    """
    if out is None or not enabled:
        return
    if out.grad_fn is None:
        # A stage without layers (a custom layout's empty stage) returned its input: there
        # is no graph to keep, and its backward accumulates into this very tensor, which
        # must keep its shape. Its storage is the received input's, held until then anyway.
        return
    if out._base is not None:
        raise ValueError(
            "deallocate_pipeline_outputs=True but a stage returned a view of another tensor: "
            "freeing it would not release memory; fix: return a fresh tensor (e.g. .clone())"
        )
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor | None) -> None:
    """Backward through a pseudo-freed output: call the C++ engine directly, since
    torch.autograd.backward insists the grad has the (now gone) shape of the output."""
    if grad_output is None:
        grad_output = torch.ones_like(output)
    Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad_output,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


@dataclass
class StepState:
    """What one forward_backward call accumulates."""

    config: PipelineConfig
    num_microbatches: int
    timeline: Timeline | None = None
    forward_data_store: list[Any] = field(default_factory=list)
    # The step's token count (per-token loss): summed on the device the losses live on, so
    # no micro-batch waits for the device; zeros on the compute device where none was seen.
    total_num_tokens: torch.Tensor | None = None

    def span(self, kind: str, microbatch: int, chunk: int) -> Any:
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(kind, microbatch, chunk)


def forward_step(
    state: StepState,
    forward_step_func: Callable[..., Any],
    data_iterator: Any,
    model: torch.nn.Module,
    input_tensor: torch.Tensor | None,
    *,
    is_last_stage: bool,
    microbatch: int,
    chunk: int = 0,
) -> torch.Tensor:
    """Run one micro-batch through one chunk: input `[s, b, h]` (None on the first stage)
    -> output `[s, b, h]`, or on the last stage the scaled loss (a scalar)."""
    with state.span("forward", microbatch, chunk):
        _set_input_tensor(model, input_tensor)
        _set_aux_loss_scale(state)
        output, loss_func = forward_step_func(data_iterator, model)
        if is_last_stage:
            output = _apply_loss(state, output, loss_func)
    return output


def _set_aux_loss_scale(state: StepState) -> None:
    """Hand the model the factor its main loss gets before backward (Megatron's forward_step
    for MoE): losses attached inside the model are back-propagated with this grad."""
    config = state.config
    if config.aux_loss_scale_func is None:
        return
    ones = torch.ones(1, device=current_device())
    scale = config.grad_scale_func(ones) if config.grad_scale_func is not None else ones
    if not config.calculate_per_token_loss:
        scale = scale / state.num_microbatches
    config.aux_loss_scale_func(scale)


def _apply_loss(state: StepState, output: Any, loss_func: Callable[..., Any]) -> torch.Tensor:
    outputs = loss_func(output)
    m = state.num_microbatches
    if len(outputs) == 3:
        loss, num_tokens, reduced = outputs
        num_tokens = torch.as_tensor(num_tokens, device=loss.device).to(torch.int)
        if not state.config.calculate_per_token_loss:
            loss = loss / torch.clamp(num_tokens, min=1) / m
        total = state.total_num_tokens
        state.total_num_tokens = num_tokens if total is None else total + num_tokens
    elif len(outputs) == 2:
        loss, reduced = outputs
        loss = loss / m
    else:
        raise ValueError(
            f"loss_func returned {len(outputs)} values; the rule: (loss, reduced) or "
            "(loss, num_tokens, reduced)"
        )
    state.forward_data_store.append(reduced)
    return loss


def backward_step(
    state: StepState,
    input_tensor: torch.Tensor | None,
    output_tensor: torch.Tensor,
    output_tensor_grad: torch.Tensor | None,
    *,
    microbatch: int,
    chunk: int = 0,
) -> torch.Tensor | None:
    """Backpropagate one micro-batch through one chunk: grad of the output `[s, b, h]`
    (None on the last stage: the loss) -> grad of the input `[s, b, h]` (None on the first)."""
    config = state.config
    with state.span("backward", microbatch, chunk):
        if input_tensor is not None:
            input_tensor.retain_grad()
        if output_tensor_grad is None and config.grad_scale_func is not None:
            output_tensor = config.grad_scale_func(output_tensor)
        if output_tensor.requires_grad:
            if config.deallocate_pipeline_outputs:
                custom_backward(output_tensor, output_tensor_grad)
            else:
                torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
        return None if input_tensor is None else input_tensor.grad


def _set_input_tensor(model: torch.nn.Module, input_tensor: torch.Tensor | None) -> None:
    target: Any = model  # the chunk, or a wrapper's .module, down to set_input_tensor
    while not hasattr(target, "set_input_tensor") and hasattr(target, "module"):
        target = target.module  # DDP-style wrappers
    if not hasattr(target, "set_input_tensor"):
        raise TypeError(
            f"{type(model).__name__} has no set_input_tensor(list); pipeline chunks "
            "receive their input through it"
        )
    target.set_input_tensor([input_tensor])


class GradSync:
    """Enters `no_sync_func()` while grads must only accumulate, leaves it to sync."""

    def __init__(self, no_sync_func: Callable[[], Any] | None) -> None:
        self._func = no_sync_func or contextlib.nullcontext
        self._context: Any = None

    def disable(self) -> None:
        if self._context is None:
            self._context = self._func()
            self._context.__enter__()

    def enable(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None


@contextlib.contextmanager
def weight_cache_window(chunks: list[torch.nn.Module]) -> Iterator[None]:
    """One schedule call as the span over which modules may cache a transform of their
    weights (Megatron's `is_first_microbatch`: TE's linears keep their FP8 cast).

    Every module with an `is_first_microbatch` attribute gets True on entry, so its first
    forward in the call recasts and caches (the module then sets False itself and reuses
    the cache), and None on exit, so a forward outside a schedule, or after an optimizer
    step, never reads a stale cache. Weights change only between calls.
    """
    modules = [m for c in chunks for m in c.modules() if hasattr(m, "is_first_microbatch")]
    for m in modules:
        # torch types Module.__getattr__ as Tensor | Module; this attribute is bool | None
        m.is_first_microbatch = True  # type: ignore[assignment]
    try:
        yield
    finally:
        for m in modules:
            m.is_first_microbatch = None  # type: ignore[assignment]  # as above


def caches_weights_per_call(schedule: Callable[..., Any]) -> Callable[..., Any]:
    """Run `schedule(model=..., ...)` inside `weight_cache_window` of its chunks."""

    @functools.wraps(schedule)
    def run(*, model: Any, **kwargs: Any) -> Any:
        with weight_cache_window(as_chunks(model)):
            return schedule(model=model, **kwargs)

    return run


def as_chunks(model: Any) -> list[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def as_iterators(data_iterator: Any, chunks: int) -> list[Iterator[Any] | None]:
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != chunks:
            raise PipelineConfigError(
                f"data_iterator is a list of {len(data_iterator)} but model has {chunks} "
                "chunk(s); the rule: one iterator per chunk; fix: pass one per chunk"
            )
        return list(data_iterator)
    return [data_iterator] * chunks


def resolve_config(config: PipelineConfig | None, chunks: list[torch.nn.Module]) -> PipelineConfig:
    config = config if config is not None else getattr(chunks[0], "config", None)
    if not isinstance(config, PipelineConfig):
        raise PipelineConfigError(
            "no PipelineConfig: pass config=PipelineConfig(...) or give the first model chunk "
            "a .config attribute holding one"
        )
    return config


def per_chunk(func: Any, chunks: int) -> list[Any] | None:
    """A grad_sync_func / param_sync_func given once applies to every chunk."""
    if func is None:
        return None
    return list(func) if isinstance(func, (list, tuple)) else [func] * chunks


def finalize(state: StepState, chunks: list[torch.nn.Module], forward_only: bool) -> None:
    func = state.config.finalize_model_grads_func
    if func is not None and not forward_only:
        tokens = None
        if state.config.calculate_per_token_loss:
            tokens = state.total_num_tokens
            if tokens is None:  # not the last stage: this rank adds 0 to the sum over pp
                tokens = torch.zeros((), dtype=torch.int, device=current_device())
        func(chunks, tokens)
