"""1F1B (PipeDream-flush), Megatron-LM's non-interleaved pipeline schedule.

Pipeline rank r of p runs:
- warm-up: min(p - r - 1, m) forwards, each received from the previous stage and sent on;
- steady: one forward, then one backward, m - warm-up times (send output + receive its
  grad in one exchange; send input grad + receive the next input in another);
- cool-down: the warm-up's backwards.
So rank r holds at most min(p - r, m) micro-batches' activations at once. Grad sync is
enabled for the last backward only (on every rank, or on the first stage only when a
grad_sync_func runs the reduction itself, which the other stages start after the loop).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pentatron.parallel_state import get_default_grid

from ..config import PipelineConfig, PipelineConfigError, check_schedule, tensor_shape
from ..p2p import P2PCommunicator
from ..timeline import Timeline
from .common import (
    GradSync,
    StepState,
    as_chunks,
    as_iterators,
    backward_step,
    caches_weights_per_call,
    deallocate_output_tensor,
    finalize,
    forward_step,
    per_chunk,
    resolve_config,
)


class _OneFOneB:
    def __init__(
        self,
        state: StepState,
        p2p: P2PCommunicator,
        forward_step_func: Any,
        iterator: Any,
        model: Any,
        shape: Any,
        forward_only: bool,
    ) -> None:
        self.state, self.p2p, self.config = state, p2p, state.config
        self.func, self.iterator, self.model = forward_step_func, iterator, model
        self.shape, self.forward_only = shape, forward_only
        m = state.num_microbatches
        self.warmup = min(p2p.pp_size - p2p.pp_rank - 1, m)
        self.remaining = m - self.warmup
        self.inputs: list[Any] = []
        self.outputs: list[Any] = []
        self.sync = GradSync(self.config.no_sync_func)
        self.next_forward = 0
        self.next_backward = 0

    # --- compute ---------------------------------------------------------------------------
    def forward(self, input_tensor: Any) -> Any:
        mb = self.next_forward
        self.next_forward += 1
        return forward_step(
            self.state,
            self.func,
            self.iterator,
            self.model,
            input_tensor,
            is_last_stage=self.p2p.is_last_stage,
            microbatch=mb,
        )

    def backward(self, output_grad: Any) -> Any:
        mb = self.next_backward
        self.next_backward += 1
        input_tensor, output = self.inputs.pop(0), self.outputs.pop(0)
        return backward_step(self.state, input_tensor, output, output_grad, microbatch=mb)

    def keep(self, input_tensor: Any, output: Any) -> None:
        if not self.forward_only:
            self.inputs.append(input_tensor)
            self.outputs.append(output)
            # Sent already: only the grad_fn is needed from here on.
            deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)

    def exchange_after_backward(self, input_grad: Any, recv_forward: bool) -> Any:
        """Send the input grad back; with `recv_forward`, receive the next input too."""
        if recv_forward:
            return self.p2p.send_backward_recv_forward(input_grad, self.shape)
        self.p2p.send_backward(input_grad)
        return None

    def enable_sync_for_last_backward(self) -> None:
        if self.config.grad_sync_func is None or self.p2p.is_first_stage:
            self.sync.enable()

    # --- phases ----------------------------------------------------------------------------
    def run(self) -> None:
        self.sync.disable()
        self.run_warmup()
        self.run_steady()
        if not self.forward_only:
            self.run_cooldown()
            self.launch_remaining_grad_sync()

    def run_warmup(self) -> None:
        for _ in range(self.warmup):
            input_tensor = self.p2p.recv_forward(self.shape)
            output = self.forward(input_tensor)
            self.p2p.send_forward(output)
            self.keep(input_tensor, output)

    def run_steady(self) -> None:
        p2p = self.p2p
        input_tensor = p2p.recv_forward(self.shape) if self.remaining else None
        for i in range(self.remaining):
            last = i == self.remaining - 1
            output = self.forward(input_tensor)
            if self.forward_only:
                p2p.send_forward(output)
                input_tensor = None if last else p2p.recv_forward(self.shape)
                continue
            output_grad = p2p.send_forward_recv_backward(output, self.shape)
            self.keep(input_tensor, output)
            if last and self.warmup == 0:
                self.enable_sync_for_last_backward()
            input_tensor = self.exchange_after_backward(self.backward(output_grad), not last)

    def run_cooldown(self) -> None:
        for i in range(self.warmup):
            if i == self.warmup - 1:
                self.enable_sync_for_last_backward()
            output_grad = self.p2p.recv_backward(self.shape)
            self.exchange_after_backward(self.backward(output_grad), False)

    def launch_remaining_grad_sync(self) -> None:
        if self.sync._context is not None:
            self.sync.enable()
            sync = per_chunk(self.config.grad_sync_func, 1)
            if sync is not None:
                if len(sync) != 1:
                    raise ValueError(
                        f"grad_sync_func: {len(sync)} callables for the 1 model chunk of the "
                        "non-interleaved schedule; fix: pass one callable (or a list of one)"
                    )
                sync[0](self.model.parameters())


@caches_weights_per_call
def forward_backward_pipelining_without_interleaving(
    *,
    forward_step_func: Any,
    data_iterator: Any,
    model: Any,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
    config: PipelineConfig | None = None,
    grid: Any = None,
    timeline: Timeline | None = None,
) -> list[Any]:
    """1F1B over the pipeline group of `grid` (default: the default grid).

    Tensors between stages: `[seq_length / cp (/ tp with sequence parallel),
    micro_batch_size, hidden_size]`. Returns the loss functions' reduced outputs (last
    stage; empty elsewhere).
    """
    return run_one_chunk(
        "1F1B",
        _OneFOneB,
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        config=config,
        grid=grid,
        timeline=timeline,
    )


def run_one_chunk(
    name: str,
    runner: Callable[..., Any],
    *,
    forward_step_func: Any,
    data_iterator: Any,
    model: Any,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
    config: PipelineConfig | None,
    grid: Any,
    timeline: Timeline | None,
    check: Callable[[PipelineConfig, bool], None] | None = None,
) -> list[Any]:
    """What the one-chunk schedules share: every check before any message (`check(config,
    forward_only)` too), then `runner(state, p2p, func, iterator, chunk, shape,
    forward_only).run()`, then finalize_model_grads_func."""
    chunks = as_chunks(model)
    if len(chunks) != 1:
        raise PipelineConfigError(
            f"{name} got {len(chunks)} model chunks; the rule: one chunk per rank; fix: pass "
            "one chunk, or use the interleaved schedule (vpp) for more"
        )
    config = resolve_config(config, chunks)
    if check is not None:
        check(config, forward_only)
    grid = grid if grid is not None else get_default_grid()
    tp, cp = grid.size("tp"), grid.size("cp")
    check_schedule(
        config,
        pp=grid.size("pp"),
        vpp=None,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        tp=tp,
        cp=cp,
    )
    shape = tensor_shape(config, seq_length, micro_batch_size, tp, cp)
    (iterator,) = as_iterators(data_iterator, 1)
    state = StepState(config, num_microbatches, timeline)
    p2p = P2PCommunicator.from_grid(grid, config, timeline)
    runner(state, p2p, forward_step_func, iterator, chunks[0], shape, forward_only).run()
    finalize(state, chunks, forward_only)
    return state.forward_data_store
