"""Checkpoints of the training app, reloadable at another tp / pp / vpp / dp layout.

    save_checkpoint(save_dir, iteration, model_chunks, optimizer, scheduler, *, grid,
                    config, consumed_samples, args, keep_last=None,
                    async_saver=None) -> iter dir
    AsyncSaver(): --async-save (background writes, published by finalize())
    load_checkpoint(load_dir, model_chunks, optimizer, scheduler, *, grid, config,
                    load_optim=True, load_rng=True, finetune=False, iteration=None)
        -> LoadedCheckpoint(iteration, consumed_samples, args) | None
    read_latest_iteration(load_dir) -> int | None

Modules: `layout` (folders, latest file, keep-last), `rectangles` (where a tp shard lies in
the global tensor), `planner` (DCP planners for n-D chunks), `model_state`,
`optimizer_state`, `rng_state`, `common_state` (JSON metadata, config check), `save`,
`async_save`, `load`. See apps/pretrain/CHECKPOINTS.md for the format.
"""

from .async_save import AsyncSaver
from .common_state import IncompatibleCheckpointError
from .layout import iter_dir, list_iterations, read_latest_iteration
from .load import LoadedCheckpoint, load_checkpoint
from .save import save_checkpoint

__all__ = [
    "AsyncSaver",
    "IncompatibleCheckpointError",
    "LoadedCheckpoint",
    "iter_dir",
    "list_iterations",
    "load_checkpoint",
    "read_latest_iteration",
    "save_checkpoint",
]
