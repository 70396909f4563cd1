"""`load_checkpoint`: read a `save_checkpoint` folder at any tp / pp / vpp / dp layout.

Model params always load; optimizer and scheduler unless `load_optim=False` or
`finetune=True` (then the fp32 main params are refreshed from the loaded model params);
RNG only at the saved layout and world size (else a logged notice). Tensors come through
DCP (`weights_only` loads), the rest from `common.json`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from pentatron.optim import FSDP2Optimizer
from pentatron.optim.dcp_chunks import ChunkLoadPlanner
from pentatron.parallel_state import ProcessGrid, comm

from . import layout
from .common_state import (
    IncompatibleCheckpointError,
    check_model,
    model_fields,
    read_common,
)
from .common_state import layout as grid_layout
from .fsdp2_optimizer_state import FSDP2OptimizerLoad
from .model_state import model_load_entries
from .optimizer_state import OptimizerLoad, refresh_main_from_model
from .rng_state import restore_rng, rng_load_entries

logger = logging.getLogger("pentatron.pretrain")


@dataclass(frozen=True)
class LoadedCheckpoint:
    """Where training resumes: iteration and consumed samples (0 for a finetune)."""

    iteration: int
    consumed_samples: int
    args: dict[str, Any] = field(default_factory=dict)


def _check_present(wanted: dict[str, Any], saved: dict[str, Any], path: str, hint: str) -> None:
    missing = sorted(k for k in wanted if k not in saved)
    if missing:
        raise IncompatibleCheckpointError(
            f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}; {hint}"
        )


def _rng_matches(common: dict[str, Any], grid: ProcessGrid, config: Any) -> bool:
    saved, current = common["layout"], grid_layout(grid, config)
    if saved == current:
        return True
    if dist.get_rank() == 0:
        logger.warning(
            "checkpoint layout %s differs from this run's %s: RNG states are not restored",
            dict(sorted(saved.items())),
            dict(sorted(current.items())),
        )
    return False


def _resolve(load_dir: str, iteration: int | None) -> str | None:
    if iteration is None:
        iteration = layout.read_latest_iteration(load_dir)
        if iteration is None:
            return None
    path = layout.iter_dir(load_dir, iteration)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"no checkpoint folder {path}; fix: pick one of "
            f"{layout.list_iterations(load_dir)} or fix the latest file"
        )
    return path


def load_checkpoint(
    load_dir: str,
    model_chunks: Sequence[Any],
    optimizer: Any,
    scheduler: Any,
    *,
    grid: ProcessGrid,
    config: Any,
    load_optim: bool = True,
    load_rng: bool = True,
    finetune: bool = False,
    iteration: int | None = None,
) -> LoadedCheckpoint | None:
    """Collective over the world: load the latest (or `iteration`'s) checkpoint.

    Returns None when `load_dir` holds no checkpoint. Raises `IncompatibleCheckpointError`
    when the saved model config differs from `config` (the message names the field).
    """
    path = _resolve(load_dir, iteration)
    if path is None:
        return None
    common = read_common(path)
    check_model(common["model"], model_fields(config, model_chunks[0]), path)
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    for chunk in model_chunks:
        chunk.finish_param_sync()
    sd = model_load_entries(model_chunks, grid)
    _check_present(sd, saved, path, "fix: save and load the same model")
    opt_load: OptimizerLoad | FSDP2OptimizerLoad | None = None
    fsdp2 = isinstance(optimizer, FSDP2Optimizer)
    if optimizer is not None and load_optim and not finetune:
        opt_load = (FSDP2OptimizerLoad if fsdp2 else OptimizerLoad)(optimizer, grid, set(saved))
        hint = "it was saved without an optimizer; fix: pass load_optim=False"
        _check_present(opt_load.entries, saved, path, hint)
        sd.update(opt_load.entries)
    rank = dist.get_rank()
    rng = {}
    if load_rng and not finetune and _rng_matches(common, grid, config):
        rng = rng_load_entries(rank, saved)
        sd.update(rng)
    dcp.load(
        sd,
        storage_reader=FileSystemReader(path),
        planner=ChunkLoadPlanner(),
        process_group=grid.host_group,
    )
    if opt_load is not None:
        opt_load.apply(common)
    elif optimizer is not None and not fsdp2:  # FSDP2's params are its main params
        refresh_main_from_model(optimizer)
    if scheduler is not None and load_optim and not finetune and common["scheduler"]:
        scheduler.load_state_dict(common["scheduler"])
    if rng:
        restore_rng(rank, rng)
    comm.barrier(grid.host_group)
    if finetune:
        return LoadedCheckpoint(0, 0, common["args"])
    return LoadedCheckpoint(common["iteration"], common["consumed_samples"], common["args"])
