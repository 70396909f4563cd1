"""No pipelining (p = 1): gradient accumulation over the micro-batches.

Every micro-batch but the last runs inside `no_sync_func()`, so grads only accumulate and
the data-parallel reduction starts during the last backward.
"""

from __future__ import annotations

from typing import Any

from ..config import PipelineConfig, check_schedule
from ..timeline import Timeline
from .common import (
    GradSync,
    StepState,
    as_chunks,
    as_iterators,
    backward_step,
    caches_weights_per_call,
    finalize,
    forward_step,
    resolve_config,
)


@caches_weights_per_call
def forward_backward_no_pipelining(
    *,
    forward_step_func: Any,
    data_iterator: Any,
    model: Any,
    num_microbatches: int,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
    forward_only: bool = False,
    config: PipelineConfig | None = None,
    grid: Any = None,
    timeline: Timeline | None = None,
) -> list[Any]:
    """Run m micro-batches through one model; returns the loss functions' reduced outputs.

    `grid` is unused (no communication); accepted so every schedule takes the same arguments.
    """
    chunks = as_chunks(model)
    if len(chunks) != 1:
        raise ValueError(f"no-pipelining schedule got {len(chunks)} model chunks; it takes one")
    config = resolve_config(config, chunks)
    check_schedule(config, pp=1, vpp=None, num_microbatches=num_microbatches)
    (iterator,) = as_iterators(data_iterator, 1)
    state = StepState(config, num_microbatches, timeline)
    sync = GradSync(config.no_sync_func)
    sync.disable()
    for mb in range(num_microbatches):
        if mb == num_microbatches - 1:
            sync.enable()  # the last backward runs with grad sync on
        _one_microbatch(state, forward_step_func, iterator, chunks[0], mb, forward_only)
    sync.enable()
    finalize(state, chunks, forward_only)
    return state.forward_data_store


def _one_microbatch(
    state: StepState, forward_step_func: Any, iterator: Any, model: Any, mb: int, forward_only: bool
) -> None:
    output = forward_step(
        state, forward_step_func, iterator, model, None, is_last_stage=True, microbatch=mb
    )
    if not forward_only:
        backward_step(state, None, output, None, microbatch=mb)
