"""ZBV, the V-shaped zero-bubble schedule (Qi et al., arXiv 2401.10241): the executor of
`zero_bubble.zbv_schedules`.

Two chunks per rank in a V (`zero_bubble.v_stage`): chunk 0 of rank r is stage r, chunk 1
is stage 2p - 1 - r, so activations run down the ranks through chunk 0, turn at rank p - 1
(its chunk 0 hands its output to its chunk 1 in memory) and come back up through chunk 1;
rank 0 holds the first stage and the loss. Each rank runs its table's ops in order: F, B
(inside `config.weight_grad_store.defer()`, as ZB-H1) and W.

Messages: a tensor is sent (isend) as soon as it is made and received (irecv, waited) just
before it is used. Between two ranks chunk 0's activations and chunk 1's grads both go
down, chunk 1's activations and chunk 0's grads both go up, so the two chunks use two
channels (chunk 0 the pp group, chunk 1 its twin, `ProcessGrid.twin_group`): on each
channel and direction one stream, in micro-batch order on both sides (the table keeps
each (kind, chunk) in order), so every receive matches its send.

`deallocate_pipeline_outputs`: a sent output is pseudo-freed once its send completed, at
the latest just before its backward (its grad came back, so the peer holds it; gloo
reports a send complete only when waited, NCCL as soon as it is).

Grad sync as ZB-H1: off until the rank's last op (a W); `grad_sync_func`, if given, is
called for each chunk after it.
"""

from __future__ import annotations

from typing import Any

import torch

from pentatron.parallel_state import comm, current_device, get_default_grid

from ..config import PipelineConfig, PipelineConfigError, check_schedule, tensor_shape
from ..timeline import Timeline
from ..zero_bubble import zbv_schedules
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


class _ZBV:
    def __init__(
        self, state: StepState, grid: Any, func: Any, iterators: list, chunks: list, shape: Any
    ) -> None:
        self.state, self.config = state, state.config
        self.func, self.iterators, self.chunks, self.shape = func, iterators, chunks, shape
        self.p, self.r = grid.size("pp"), grid.rank("pp")
        ranks = grid.ranks("pp")
        self.up = ranks[self.r - 1] if self.r > 0 else None  # toward rank 0
        self.down = ranks[self.r + 1] if self.r < self.p - 1 else None
        self.channel = [grid.group("pp"), grid.twin_group("pp")]  # chunk 0, chunk 1
        self.store = self.config.weight_grad_store
        self.sync = GradSync(self.config.no_sync_func)
        self.inputs: dict[tuple[int, int], Any] = {}
        self.outputs: dict[tuple[int, int], Any] = {}
        self.turn_grads: dict[int, Any] = {}  # rank p-1: chunk 1's input grad, chunk 0's dY
        # Posted sends: (handle, tensor kept alive until sent, key of an output to
        # pseudo-free once sent or None). A handle is waited exactly once (gloo's send work
        # blocks on a second wait).
        self.sends: list[tuple[Any, Any, tuple[int, int] | None]] = []

    # --- messages -------------------------------------------------------------------------
    def send(self, tensor: Any, peer: int, chunk: int, free: tuple[int, int] | None) -> None:
        """Post `tensor` to `peer`; `free`: the key of an output to pseudo-free once sent."""
        tensor = tensor.contiguous()
        handle = comm.isend(tensor, peer, group=self.channel[chunk])
        self.sends.append((handle, tensor, free))

    def complete_sends(self, wait: bool = False, key: tuple[int, int] | None = None) -> None:
        """Retire the sends that completed (all with `wait`, and the one of output `key`),
        pseudo-freeing their outputs when asked."""
        pending = []
        for handle, tensor, free in self.sends:
            if wait or (free is not None and free == key) or handle.is_completed():
                handle.wait()
                if free is not None:
                    deallocate_output_tensor(tensor, True)
            else:
                pending.append((handle, tensor, free))
        self.sends = pending

    def recv(self, peer: int, chunk: int) -> torch.Tensor:
        buf = torch.empty(
            self.shape,
            dtype=self.config.pipeline_dtype,
            device=current_device(),
            requires_grad=True,
        )
        comm.irecv(buf, peer, group=self.channel[chunk]).wait()
        return buf

    # --- ops ------------------------------------------------------------------------------
    def forward(self, mb: int, chunk: int, keep: bool = True) -> None:
        """F; `keep` (training): hold its input and output for B."""
        if chunk == 0:
            inp = None if self.up is None else self.recv(self.up, 0)
        elif self.down is None:  # the turn of the V: chunk 0's output, here
            turned = self.outputs[(mb, 0)] if keep else self.outputs.pop((mb, 0))
            inp = turned.detach().requires_grad_()
        else:
            inp = self.recv(self.down, 1)
        is_last = chunk == 1 and self.r == 0
        out = forward_step(
            self.state,
            self.func,
            self.iterators[chunk],
            self.chunks[chunk],
            inp,
            is_last_stage=is_last,
            microbatch=mb,
            chunk=chunk,
        )
        peer = self.down if chunk == 0 else self.up
        if keep or (chunk == 0 and peer is None):
            self.outputs[(mb, chunk)] = out
        if keep:
            self.inputs[(mb, chunk)] = inp
        if peer is not None:
            free = keep and self.config.deallocate_pipeline_outputs
            self.send(out, peer, chunk, (mb, chunk) if free else None)

    def backward(self, mb: int, chunk: int) -> None:
        if chunk == 1:
            grad = None if self.up is None else self.recv(self.up, 1)
        elif self.down is None:
            grad = self.turn_grads.pop(mb)
        else:
            grad = self.recv(self.down, 0)
        # The grad came from the peer that took this output: its send is done, so waiting
        # on it here cannot block, and the output must be freed before its backward.
        self.complete_sends(key=(mb, chunk))
        inp, out = self.inputs.pop((mb, chunk)), self.outputs.pop((mb, chunk))
        with self.store.defer():
            in_grad = backward_step(self.state, inp, out, grad, microbatch=mb, chunk=chunk)
        self.store.close_group()
        peer = self.down if chunk == 1 else self.up
        if chunk == 1 and peer is None:
            self.turn_grads[mb] = in_grad
        elif peer is not None:
            self.send(in_grad, peer, chunk, None)

    def weight(self, mb: int, chunk: int) -> None:
        with self.state.span("weight", mb, chunk):
            self.store.run_oldest()

    # --- the step -------------------------------------------------------------------------
    def run(self, ops: list, forward_only: bool) -> None:
        if forward_only:
            for op in ops:
                if op.kind == "F":
                    self.forward(op.microbatch, op.chunk, keep=False)
            self.drain()
            return
        self.sync.disable()
        try:
            for i, op in enumerate(ops):
                if i == len(ops) - 1:  # every rank's last op is a W: the grads are whole
                    self.sync.enable()
                self.complete_sends()
                {"F": self.forward, "B": self.backward, "W": self.weight}[op.kind](
                    op.microbatch, op.chunk
                )
        except BaseException:
            self.store.clear()
            raise
        self.drain()
        self.sync.enable()
        grad_sync = per_chunk(self.config.grad_sync_func, 2)
        for sync, chunk in zip(grad_sync or [], self.chunks):
            sync(chunk.parameters())

    def drain(self) -> None:
        self.complete_sends(wait=True)


@caches_weights_per_call
def forward_backward_pipelining_zbv(
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
    """ZBV over the pipeline group of `grid` (default: the default grid). `model`: this
    rank's two chunks [stage r, stage 2p - 1 - r]; `data_iterator`: one per chunk or one
    for both. Needs `config.weight_grad_store`. Returns the loss functions' reduced outputs
    on pipeline rank 0 (the last stage of the V), empty elsewhere."""
    chunks = as_chunks(model)
    if len(chunks) != 2:
        raise PipelineConfigError(
            f"ZBV got {len(chunks)} model chunks; the rule: two per rank, [stage r, stage "
            "2p - 1 - r] (`zero_bubble.v_stage`); fix: build both and pass them as a list"
        )
    config = resolve_config(config, chunks)
    if config.weight_grad_store is None and not forward_only:
        raise PipelineConfigError(
            "ZBV with weight_grad_store=None: the schedule defers weight gradients into a "
            "store; fix: PipelineConfig(weight_grad_store=pentatron.tp_layers.WeightGradStore())"
        )
    grid = grid if grid is not None else get_default_grid()
    tp, cp, pp = grid.size("tp"), grid.size("cp"), grid.size("pp")
    check_schedule(
        config, pp=pp, vpp=None, num_microbatches=num_microbatches, seq_length=seq_length,
        tp=tp, cp=cp,
    )  # fmt: skip
    shape = tensor_shape(config, seq_length, micro_batch_size, tp, cp)
    state = StepState(config, num_microbatches, timeline)
    ops = zbv_schedules(pp, num_microbatches)[grid.rank("pp")]
    executor = _ZBV(state, grid, forward_step_func, as_iterators(data_iterator, 2), chunks, shape)
    executor.run(ops, forward_only)
    finalize(state, chunks, forward_only)
    return state.forward_data_store
