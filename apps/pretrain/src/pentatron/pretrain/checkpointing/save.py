"""`save_checkpoint`: one collective save of model, optimizer, scheduler, RNG and metadata.

Coordination (barriers, DCP's planning) runs on the grid's host group (gloo), the tensors
stay where they are (DCP copies device tensors to the host as it writes them).

Order (so a crash at any point leaves the previous latest checkpoint loadable):
1. rank 0 clears a stale `iter_N.tmp` left by an interrupted save; barrier;
2. every rank writes its chunks into `iter_N.tmp` with DCP; rank 0 adds `common.json`;
3. barrier; rank 0 renames `iter_N.tmp` -> `iter_N`, rewrites the latest file (atomically,
   tmp + os.replace), then deletes checkpoints beyond `keep_last`; barrier.
With an `AsyncSaver` (--async-save), step 2 copies the tensors and writes them in a
background thread, and step 3 runs when every rank has finished (`AsyncSaver.finalize`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from pentatron.optim import FSDP2Optimizer
from pentatron.optim.dcp_chunks import ChunkSavePlanner
from pentatron.parallel_state import ProcessGrid, comm

from . import layout
from .common_state import layout as grid_layout
from .common_state import model_fields, write_common
from .fsdp2_optimizer_state import fsdp2_optimizer_save_entries
from .model_state import model_save_entries
from .optimizer_state import groups_state, optimizer_save_entries
from .rng_state import capture_rng


def _common(iteration, chunks, optimizer, scheduler, grid, config, consumed_samples, args):
    scaler = optimizer.grad_scaler if optimizer is not None else None
    return {
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "args": args,
        "model": model_fields(config, chunks[0]),
        "layout": grid_layout(grid, config),
        "has_optimizer": optimizer is not None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "param_groups": groups_state(optimizer) if optimizer is not None else [],
        "grad_scaler": scaler.state_dict() if scaler is not None else None,
    }


def _check_json(args: dict[str, Any]) -> None:
    try:
        json.dumps(args)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"save_checkpoint: args is not JSON-able ({e}); fix: pass plain values "
            "(str, int, float, bool, None, lists and dicts of them)"
        ) from None


def _publish(root: str, tmp: str, final: str, iteration: int, keep_last: int | None) -> None:
    """Rank 0, after every rank wrote: make the folder visible, then point latest at it."""
    if os.path.exists(final):  # re-saving an iteration replaces it
        shutil.rmtree(final)
    os.rename(tmp, final)
    layout.write_latest_iteration(root, iteration)
    if keep_last is not None:
        layout.prune(root, keep_last)


def save_checkpoint(
    save_dir: str,
    iteration: int,
    model_chunks: Sequence[Any],
    optimizer: Any,
    scheduler: Any,
    *,
    grid: ProcessGrid,
    config: Any,
    consumed_samples: int,
    args: dict[str, Any],
    keep_last: int | None = None,
    async_saver: Any = None,
) -> str:
    """Collective over the world: save `save_dir/iter_<iteration>`; returns that path.

    `model_chunks`: this rank's DDP-wrapped GPTModel chunks (one per virtual stage);
    `optimizer` / `scheduler` may be None; `args` must be JSON-able. With `async_saver`
    the path becomes visible only when `async_saver.finalize` publishes it.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: must be >= 1; fix: pass None to keep all")
    _check_json(args)  # on every rank, before any collective: rank 0 alone must not fail
    final, tmp = layout.iter_dir(save_dir, iteration), layout.temp_dir(save_dir, iteration)
    first = dist.get_rank() == 0
    if async_saver is not None:
        async_saver.finalize(blocking=True)  # one save in flight at a time
    if first:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    for chunk in model_chunks:
        chunk.finish_param_sync()  # an overlapped all-gather may still be in flight
    comm.barrier(grid.host_group)
    sd = model_save_entries(model_chunks, grid)
    if isinstance(optimizer, FSDP2Optimizer):
        sd.update(fsdp2_optimizer_save_entries(optimizer, model_chunks, grid))
    elif optimizer is not None:
        sd.update(optimizer_save_entries(optimizer, model_chunks, grid))
    sd.update(capture_rng(dist.get_rank()))
    common = None
    if first:  # captured now: the scheduler moves on while an async write runs
        common = _common(
            iteration, model_chunks, optimizer, scheduler, grid, config, consumed_samples, args
        )
    if async_saver is not None:
        if common is not None:  # the first rank
            os.makedirs(tmp, exist_ok=True)  # the other ranks' writer threads may be first
            write_common(tmp, common)
        publish = partial(_publish, save_dir, tmp, final, iteration, keep_last)
        async_saver.start(sd, tmp, iteration, publish)
        return final
    dcp.save(
        sd,
        storage_writer=FileSystemWriter(tmp),
        planner=ChunkSavePlanner(),
        process_group=grid.host_group,
    )
    if common is not None:  # the first rank
        write_common(tmp, common)
    comm.barrier(grid.host_group)  # every rank's files are complete before it is visible
    if first:
        _publish(save_dir, tmp, final, iteration, keep_last)
    comm.barrier(grid.host_group)
    return final
