"""ZB-H1, the zero-bubble schedule with 1F1B's memory (Qi et al., arXiv 2401.10241).

The executor of `zero_bubble.zb_h1_rank_schedule`: 1F1B's forwards, p2p exchanges and
backward order, each backward being only B (the input gradient, run inside
`config.weight_grad_store.defer()`, so the parallel linears queue their weight gradients),
and the W's (`store.run_oldest()`) placed where the table puts them: after the B that
makes one more pending than rank r keeps (r), and the rest after the last B. A W runs
while the input gradient it follows is on its way to the previous stage (and the next
forward's input on its way here): the exchange is posted, the W's run, then it is waited.

Grad sync: grads accumulate with sync off (`no_sync_func`) through every B and W except
the W of the last micro-batch, which on every rank is its last op: the hooks that fire
there mark params ready (DDP launches a bucket once all its params are), the buckets
holding params whose gradients all came in B are reduced by `finalize_model_grads_func`
(DDP's finish_grad_sync launches what was not launched). With a `grad_sync_func`, stages
other than the first call it after the last W, as 1F1B does after its last backward.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ..config import PipelineConfig, PipelineConfigError
from ..p2p import P2PCommunicator
from ..timeline import Timeline
from ..zero_bubble import zb_h1_rank_schedule
from .common import StepState, caches_weights_per_call
from .one_f_one_b import _OneFOneB, run_one_chunk


def weights_after_backward(pp: int, rank: int, num_microbatches: int) -> dict[int, list[int]]:
    """{micro-batch of a B: the micro-batches whose W's follow it} in rank's ZB-H1 table."""
    table = zb_h1_rank_schedule(pp, rank, num_microbatches)
    after: dict[int, list[int]] = {}
    last_b = -1
    for op in table:
        if op.kind == "B":
            last_b = op.microbatch
            after[last_b] = []
        elif op.kind == "W":
            after[last_b].append(op.microbatch)
    return after


class _ZeroBubbleH1(_OneFOneB):
    def __init__(self, *args: Any, store: Any) -> None:
        super().__init__(*args)
        self.store = store
        m = self.state.num_microbatches
        self.weights_after = weights_after_backward(self.p2p.pp_size, self.p2p.pp_rank, m)
        self.due: list[int] = []
        self.pending: deque[int] = deque()  # micro-batches whose B ran and W has not

    def run(self) -> None:
        try:
            super().run()
        except BaseException:
            self.store.clear()  # the step is lost: so are its pending W's (and what they hold)
            raise

    def backward(self, output_grad: Any) -> Any:
        mb = self.next_backward
        with self.store.defer():
            input_grad = super().backward(output_grad)
        self.store.close_group()
        self.pending.append(mb)
        self.due = self.weights_after[mb]
        return input_grad

    def enable_sync_for_last_backward(self) -> None:
        """Sync stays off through the B's; the last W turns it on (`run_due_weights`)."""

    def exchange_after_backward(self, input_grad: Any, recv_forward: bool) -> Any:
        """Post the exchange, run the W's the table puts after this B, then wait."""
        received, handles = None, dict[str, Any]()
        if not self.p2p.is_first_stage:
            received, _, handles = self.p2p.communicate(
                send_prev=input_grad,
                recv_prev=recv_forward,
                tensor_shape=self.shape,
                wait=False,
            )
        self.run_due_weights()
        for handle in handles.values():
            handle.wait()
        return received

    def run_due_weights(self) -> None:
        last = self.state.num_microbatches - 1
        for mb in self.due:
            oldest = self.pending.popleft()
            if oldest != mb:  # the table and the store disagree: a bug here, not in the user's
                raise RuntimeError(f"ZB-H1: W of micro-batch {mb} due, oldest pending is {oldest}")
            if mb == last:
                super().enable_sync_for_last_backward()
            with self.state.span("weight", mb, 0):
                self.store.run_oldest()
        self.due = []


@caches_weights_per_call
def forward_backward_pipelining_zero_bubble_h1(
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
    """ZB-H1 over the pipeline group of `grid` (default: the default grid); arguments and
    result as `forward_backward_pipelining_without_interleaving`. Needs
    `config.weight_grad_store` (e.g. `pentatron.tp_layers.WeightGradStore()`); forward-only
    calls (evaluation) run 1F1B's forwards."""
    return run_one_chunk(
        "ZB-H1",
        _runner,
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
        check=_check_store,
    )


def _check_store(config: PipelineConfig, forward_only: bool) -> None:
    if config.weight_grad_store is None and not forward_only:
        raise PipelineConfigError(
            "ZB-H1 with weight_grad_store=None: the schedule defers weight gradients into a "
            "store; fix: PipelineConfig(weight_grad_store=pentatron.tp_layers.WeightGradStore())"
        )


def _runner(state: StepState, p2p: P2PCommunicator, *args: Any) -> _OneFOneB:
    forward_only = args[-1]
    if forward_only:
        return _OneFOneB(state, p2p, *args)
    return _ZeroBubbleH1(state, p2p, *args, store=state.config.weight_grad_store)
