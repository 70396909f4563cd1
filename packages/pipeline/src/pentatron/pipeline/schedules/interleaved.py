"""Interleaved 1F1B with v model chunks per rank (Megatron-LM's virtual pipeline).

Chunk c of pipeline rank r is virtual stage c * p + r: activations go rank 0 -> ... -> p-1
-> (ring) rank 0 of the next chunk. Virtual step k runs forward of `table[k]` and backward of
the same micro-batch through chunk v - 1 - chunk (`schedule_table.get_schedule_table`).
Rank r runs (p - r - 1) * 2 + (v - 1) * group warm-up forwards (capped at m * v), then
steady one-forward-one-backward, then the cool-down backwards.

Per-chunk FIFO buffers hold received inputs, sent outputs and received output grads.
`overlap_p2p_comm` starts each steady-state exchange without waiting; a received tensor is
waited on only when the step that consumes it starts, so the transfer overlaps compute.
"""

from __future__ import annotations

from typing import Any

from pentatron.parallel_state import get_default_grid

from ..config import PipelineConfig, check_schedule, tensor_shape
from ..p2p import P2PCommunicator
from ..schedule_table import get_schedule_table, warmup_count
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


class _Interleaved:
    def __init__(
        self,
        state: StepState,
        p2p: P2PCommunicator,
        forward_step_func: Any,
        iterators: list[Any],
        chunks: list[Any],
        shape: Any,
        forward_only: bool,
        group_size: int,
    ) -> None:
        self.state, self.p2p, self.config = state, p2p, state.config
        self.func, self.iterators, self.chunks = forward_step_func, iterators, chunks
        self.shape, self.forward_only = shape, forward_only
        self.p, self.r, self.v = p2p.pp_size, p2p.pp_rank, len(chunks)
        self.m = state.num_microbatches
        self.table = get_schedule_table(self.m, self.v, group_size)
        self.total = self.m * self.v
        self.warmup = warmup_count(self.p, self.r, self.m, self.v, group_size, forward_only)
        self.all_warmup = self.warmup == self.total
        self.remaining = self.total - self.warmup
        self.inputs: list[list[Any]] = [[] for _ in chunks]
        self.outputs: list[list[Any]] = [[] for _ in chunks]
        self.grads: list[list[Any]] = [[] for _ in chunks]
        self.sync = GradSync(self.config.no_sync_func)
        self.grad_sync = None if forward_only else per_chunk(self.config.grad_sync_func, self.v)
        self.param_sync = None if forward_only else per_chunk(self.config.param_sync_func, self.v)
        self.synced: set[int] = set()
        self.pending: dict[int, Any] = {}  # id(received tensor) -> its unwaited handle
        self.send_waits: list[Any] = []

    # --- the table ------------------------------------------------------------------------
    def chunk_id(self, k: int, forward: bool) -> int:
        chunk = self.table[k % self.total][1]
        return chunk if forward else self.v - 1 - chunk

    def is_first(self, chunk: int) -> bool:
        return self.r == 0 and chunk == 0

    def is_last(self, chunk: int) -> bool:
        return self.r == self.p - 1 and chunk == self.v - 1

    def recv_plan(self, k: int, forward: bool) -> tuple[bool, int]:
        """Will a tensor arrive after step k, and for which chunk?

        The leading rank (first in forward, last in backward) runs p - 1 steps ahead of the
        trailing one, so what it receives now was produced p - 1 steps earlier.
        """
        leading = self.r == 0 if forward else self.r == self.p - 1
        if not leading:
            return True, self.chunk_id(k + 1, forward)
        recv = k >= self.p - 1
        source = self.chunk_id(k - (self.p - 1) if recv else k + 1, forward)
        if source == (self.v - 1 if forward else 0):
            recv = False  # the model's last (first) chunk sends nothing on
        return recv, source + (1 if forward else -1)

    def released(self, k: int, chunk: int) -> int:
        """Inputs of `chunk` already popped (backward done) before forward step k."""
        if self.forward_only:
            return sum(1 for _, c in self.table[:k] if c == chunk)
        if k < self.warmup:
            return 0
        mirrored = self.v - 1 - chunk
        return sum(1 for _, c in self.table[: k - self.warmup] if c == mirrored)

    # --- compute ---------------------------------------------------------------------------
    def forward(self, k: int) -> Any:
        chunk, mb = self.chunk_id(k, True), self.table[k][0]
        self.start_param_sync(k)
        if self.is_first(chunk) and len(self.inputs[chunk]) == len(self.outputs[chunk]):
            self.inputs[chunk].append(None)
        input_tensor = self.inputs[chunk][mb - self.released(k, chunk)]
        self.wait_for(input_tensor)
        output = forward_step(
            self.state,
            self.func,
            self.iterators[chunk],
            self.chunks[chunk],
            input_tensor,
            is_last_stage=self.is_last(chunk),
            microbatch=mb,
            chunk=chunk,
        )
        self.outputs[chunk].append(output)
        if self.forward_only:
            self.inputs[chunk].pop(0)
            self.outputs[chunk].pop()
        return output

    def backward(self, k: int) -> Any:
        chunk, mb = self.chunk_id(k, False), self.table[k][0]
        if self.grad_sync is None and mb == self.m - 1:
            self.sync.enable()  # last micro-batch of this chunk: let its grads reduce
            self.synced.add(chunk)
        if self.is_last(chunk) and not self.grads[chunk]:
            self.grads[chunk].append(None)
        input_tensor = self.inputs[chunk].pop(0)
        output = self.outputs[chunk].pop(0)
        output_grad = self.grads[chunk].pop(0)
        self.wait_for(output_grad)
        input_grad = backward_step(
            self.state, input_tensor, output, output_grad, microbatch=mb, chunk=chunk
        )
        self.start_custom_grad_sync(k)
        self.sync.disable()
        return input_grad

    def start_param_sync(self, k: int) -> None:
        # Launched at the same step on every rank (k + r), one chunk ahead of its first use.
        if self.param_sync is None:
            return
        ahead = k + self.r
        if ahead < self.total and self.table[ahead][0] == 0:
            chunk = self.chunk_id(ahead, True) + 1
            if 1 < chunk < self.v:
                self.param_sync[chunk](self.chunks[chunk].parameters())

    def start_custom_grad_sync(self, k: int) -> None:
        # Launched at the same step on every rank (k - r), after the chunk's last backward.
        if self.grad_sync is None:
            return
        behind = k - self.r
        if behind >= 0 and self.table[behind][0] == self.m - 1:
            chunk = self.chunk_id(behind, False)
            self.sync.enable()
            self.grad_sync[chunk](self.chunks[chunk].parameters())
            self.synced.add(chunk)

    # --- p2p bookkeeping -------------------------------------------------------------------
    def wait_for(self, tensor: Any) -> None:
        handle = self.pending.pop(id(tensor), None) if tensor is not None else None
        if handle is not None:
            handle.wait()

    def track(
        self, received: Any, handles: dict[str, Any], recv_key: str, send_key: str, sent: Any
    ) -> None:
        if recv_key in handles:
            self.pending[id(received)] = handles[recv_key]
        if send_key in handles:
            if self.config.deallocate_pipeline_outputs and send_key == "send_next":
                handles[send_key].wait()  # the sent buffer is about to be freed
            else:
                self.send_waits.append(handles[send_key])

    def drain(self) -> None:
        for handle in [*self.pending.values(), *self.send_waits]:
            handle.wait()
        self.pending.clear()
        self.send_waits.clear()

    # --- phases ----------------------------------------------------------------------------
    def run(self) -> None:
        self.sync.disable()
        if self.param_sync is not None:
            for chunk in range(min(2, self.v)):
                self.param_sync[chunk](self.chunks[chunk].parameters())
        self.inputs[0].append(self.p2p.recv_forward(self.shape, self.is_first(0)))
        self.run_warmup()
        self.run_steady()
        if not self.forward_only:
            self.run_cooldown()
        self.drain()

    def run_warmup(self) -> None:
        p2p, overlap = self.p2p, self.config.overlap_p2p_comm
        for k in range(self.warmup):
            chunk = self.chunk_id(k, True)
            recv_prev, next_chunk = self.recv_plan(k, True)
            if k == self.total - 1:
                recv_prev = False
            output = self.forward(k)
            if self.is_last(chunk):
                output = None
            last_warmup = k == self.warmup - 1 and not self.forward_only and not self.all_warmup
            recv_next = not p2p.is_last_stage
            if last_warmup and not overlap:
                # Also fetch the first output grad, needed by the first steady backward.
                received, grad = p2p.send_forward_backward_recv_forward_backward(
                    output, None, recv_prev, recv_next, self.shape
                )
                self.grads[self.v - 1].append(grad)
            else:
                received = p2p.send_forward_recv_forward(output, recv_prev, self.shape)
            if recv_prev:
                self.inputs[next_chunk].append(received)
            deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)
            if last_warmup and overlap:
                grad, handles = p2p.send_backward_recv_backward(None, recv_next, self.shape, True)
                self.track(grad, handles, "recv_next", "send_prev", None)
                if recv_next:
                    self.grads[self.v - 1].append(grad)

    def run_steady(self) -> None:
        step = self.steady_step_overlapped if self.config.overlap_p2p_comm else self.steady_step
        output = None
        for k in range(self.remaining):
            output = step(k, output)
        deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)

    def steady_step(self, k: int, _previous_output: Any) -> Any:
        fk = k + self.warmup
        output = self.forward(fk)
        input_grad = self.backward(k) if not self.forward_only else None
        if self.is_last(self.chunk_id(fk, True)):
            output = None
        if self.forward_only or self.is_first(self.chunk_id(k, False)):
            input_grad = None
        recv_prev, next_fwd = self.recv_plan(fk, True)
        recv_next, next_bwd = self.recv_plan(k, False)
        if k == self.remaining - 1:
            recv_prev = False
        if self.forward_only:
            received = self.p2p.send_forward_recv_forward(output, recv_prev, self.shape)
            grad, recv_next = None, False
        else:
            received, grad = self.p2p.send_forward_backward_recv_forward_backward(
                output, input_grad, recv_prev, recv_next, self.shape
            )
        deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)
        if recv_prev:
            self.inputs[next_fwd].append(received)
        if recv_next:
            self.grads[next_bwd].append(grad)
        return None

    def steady_step_overlapped(self, k: int, previous_output: Any) -> Any:
        p2p, fk = self.p2p, k + self.warmup
        deallocate_output_tensor(previous_output, self.config.deallocate_pipeline_outputs)
        output = self.forward(fk)
        if self.is_last(self.chunk_id(fk, True)):
            output = None
        recv_prev, next_fwd = self.recv_plan(fk, True)
        if k == self.remaining - 1:
            recv_prev = False
        received, handles = p2p.send_forward_recv_forward(output, recv_prev, self.shape, True)
        self.track(received, handles, "recv_prev", "send_next", output)
        if recv_prev:
            self.inputs[next_fwd].append(received)
        # The backward below runs while the activation transfer is in flight.
        input_grad = self.backward(k)
        if self.is_first(self.chunk_id(k, False)):
            input_grad = None
        recv_next, next_bwd = self.recv_plan(k, False)
        grad, handles = p2p.send_backward_recv_backward(input_grad, recv_next, self.shape, True)
        self.track(grad, handles, "recv_next", "send_prev", input_grad)
        if recv_next:
            self.grads[next_bwd].append(grad)
        return output

    def run_cooldown(self) -> None:
        p2p = self.p2p
        if self.all_warmup:
            self.grads[self.v - 1].append(p2p.recv_backward(self.shape, self.is_last(self.v - 1)))
        for k in range(self.remaining, self.total):
            chunk = self.chunk_id(k, False)
            recv_next, next_chunk = self.recv_plan(k, False)
            if k == self.total - 1:
                recv_next = False
            input_grad = self.backward(k)
            if self.is_first(chunk):
                input_grad = None
            grad = p2p.send_backward_recv_backward(input_grad, recv_next, self.shape)
            if recv_next:
                self.grads[next_chunk].append(grad)
        self.sync.enable()
        if self.grad_sync is not None:
            for chunk in range(self.v):
                if chunk not in self.synced:
                    self.grad_sync[chunk](self.chunks[chunk].parameters())
                    self.synced.add(chunk)


@caches_weights_per_call
def forward_backward_pipelining_with_interleaving(
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
    """Interleaved 1F1B over the pipeline group of `grid` (default: the default grid).

    `model` is this rank's list of v chunks, `data_iterator` one iterator per chunk (or one
    shared). Tensors between stages: `[seq_length / cp (/ tp), micro_batch_size, hidden]`.
    Needs pp <= microbatch_group_size_per_vp_stage <= num_microbatches and
    num_microbatches % group size in {0} or >= pp (checked before any p2p).
    """
    chunks = as_chunks(model)
    config = resolve_config(config, chunks)
    grid = grid if grid is not None else get_default_grid()
    pp, tp, cp = grid.size("pp"), grid.size("tp"), grid.size("cp")
    check_schedule(
        config,
        pp=pp,
        vpp=len(chunks),
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        tp=tp,
        cp=cp,
    )
    shape = tensor_shape(config, seq_length, micro_batch_size, tp, cp)
    iterators = as_iterators(data_iterator, len(chunks))
    state = StepState(config, num_microbatches, timeline)
    p2p = P2PCommunicator.from_grid(grid, config, timeline)
    _Interleaved(
        state, p2p, forward_step_func, iterators, chunks, shape, forward_only, config.group_size(pp)
    ).run()
    finalize(state, chunks, forward_only)
    return state.forward_data_store
