"""`load_checkpoint`: read a `save_checkpoint` folder at any tp / pp / vpp / dp layout.

Model params always load; optimizer and scheduler unless `load_optim=False` or
`finetune=True` (then the fp32 main params are refreshed from the loaded model params);
RNG only at the saved layout and world size (else a logged notice). Tensors come through
DCP (`weights_only` loads), the rest from `common.json`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from pentatron.optim import FSDP2Optimizer, SchedulerMismatchError
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
from .model_state import PREFIX as MODEL_PREFIX
from .model_state import model_keys, model_load_entries, padding_to_skip
from .optimizer_state import OptimizerLoad, refresh_main_from_model
from .rectangles import VOCAB_PADDING
from .rng_state import restore_rng, rng_load_entries

logger = logging.getLogger("pentatron.pretrain")


@dataclass(frozen=True)
class LoadedCheckpoint:
    """Where training resumes: iteration and consumed samples (0 for a finetune)."""

    iteration: int
    consumed_samples: int
    args: dict[str, Any] = field(default_factory=dict)


def _check_present(wanted: Collection[str], saved: Collection[str], path: str, hint: str) -> None:
    missing = sorted(k for k in wanted if k not in saved)
    if missing:
        raise IncompatibleCheckpointError(
            f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}; {hint}"
        )


# Megatron's --dist-ckpt-strictness: (raise on missing, raise on unexpected, log them).
# return_* hand the keys to a caller in Megatron; the app has none, so they log.
STRICTNESS = {
    "assume_ok_unexpected": (True, False, False),
    "log_unexpected": (True, False, True),
    "log_all": (False, False, True),
    "raise_unexpected": (True, True, False),
    "raise_all": (True, True, False),
    "return_unexpected": (True, False, True),
    "return_all": (False, False, True),
    "ignore_all": (False, False, False),
}


def _model_mismatch(
    chunks: Sequence[Any], grid: ProcessGrid, saved: set[str], path: str, strictness: str
) -> frozenset[str]:
    """Check the model keys per `strictness` (vocabulary padding aside: `padding_to_skip`);
    the rectangle keys to skip (missing, not raised)."""
    raise_missing, raise_unexpected, log = STRICTNESS[strictness]
    wanted = model_keys(chunks, grid)
    missing = sorted(wanted - saved)
    if raise_unexpected or log:  # unexpected: saved model keys no rank loads
        every: list[set[str] | None] = [None] * dist.get_world_size(grid.host_group)
        dist.all_gather_object(every, wanted, group=grid.host_group)
        loaded = set().union(*(s for s in every if s is not None))
        unexpected = sorted(
            k
            for k in saved
            if k.startswith(MODEL_PREFIX) and k not in loaded and not k.endswith(VOCAB_PADDING)
        )
        if unexpected and raise_unexpected:
            raise IncompatibleCheckpointError(
                f"checkpoint {path} holds {len(unexpected)} tensors this model does not have, "
                f"e.g. {unexpected[:3]}; fix: load the same model, or pass "
                "--dist-ckpt-strictness log_unexpected to load anyway"
            )
        if unexpected and log and dist.get_rank() == 0:
            logger.warning("checkpoint %s: unexpected tensors not loaded: %s", path, unexpected)
    if missing and raise_missing:
        _check_present(
            wanted,
            saved,
            path,
            "fix: load the model that was saved, or pass --dist-ckpt-strictness log_all to "
            "keep their initial values",
        )
    if missing and log:
        logger.warning(
            "checkpoint %s: missing tensors keep their initial values: %s", path, missing
        )
    return frozenset(k[len(MODEL_PREFIX) :] for k in missing)


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


# The flags behind each field the scheduler checkpoints (their values in iterations or, with
# --train-samples, in samples).
_SCHEDULER_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "--lr-warmup-iters / --lr-warmup-samples",
    "lr_decay_steps": "--lr-decay-iters / --lr-decay-samples",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "--start-weight-decay (or --weight-decay)",
    "end_wd": "--end-weight-decay (or --weight-decay)",
    "wd_incr_steps": "--train-iters / --train-samples",
    "wd_incr_style": "--weight-decay-incr-style",
}


def _load_scheduler(scheduler: Any, state: dict[str, Any], path: str) -> None:
    """Megatron's rule, in the flags a user types: a schedule that differs from the
    checkpoint's needs one of the two flags saying which wins."""
    try:
        scheduler.load_state_dict(state)
    except SchedulerMismatchError as e:
        flag = _SCHEDULER_FLAGS.get(e.field, e.field)
        raise IncompatibleCheckpointError(
            f"--load {path}: the lr schedule's {e.field} ({flag}) is {e.mine!r} in this run "
            f"and {e.saved!r} in the checkpoint; fix: add --use-checkpoint-opt_param-scheduler "
            "to take the checkpoint's, or --override-opt_param-scheduler to keep this run's"
        ) from None


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
    strictness: str = "assume_ok_unexpected",
    auto_detect_format: bool = False,
) -> LoadedCheckpoint | None:
    """Collective over the world: load the latest (or `iteration`'s) checkpoint.

    Returns None when `load_dir` holds no checkpoint. Raises `IncompatibleCheckpointError`
    when the saved model config differs from `config` (the message names the field).
    `strictness`: Megatron's --dist-ckpt-strictness for model tensors the checkpoint and the
    model do not share (see STRICTNESS; missing ones raise by default).
    `auto_detect_format` (--auto-detect-ckpt-format): read the folder's format first, and
    refuse one this code cannot read by its name (Megatron-LM's legacy or own formats).
    """
    path = _resolve(load_dir, iteration)
    if path is None:
        return None
    if auto_detect_format:
        found = layout.detect_format(path)
        if found != "torch_dist":
            raise IncompatibleCheckpointError(
                f"--load {path}: --auto-detect-ckpt-format found a {found!r} checkpoint; this "
                "release reads only its own torch_dist folders (DCP files + common.json); "
                "fix: convert the weights to Hugging Face and import them with pentatron-convert, or start fresh"
            )
    common = read_common(path)
    check_model(common["model"], model_fields(config, model_chunks[0]), path)
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    for chunk in model_chunks:
        chunk.finish_param_sync()
    padding = padding_to_skip(model_chunks, grid, saved)
    skip = _model_mismatch(model_chunks, grid, set(saved), path, strictness) | padding
    sd = model_load_entries(model_chunks, grid, skip)
    opt_load: OptimizerLoad | FSDP2OptimizerLoad | None = None
    fsdp2 = isinstance(optimizer, FSDP2Optimizer)
    if optimizer is not None and load_optim and not finetune:
        load_cls = FSDP2OptimizerLoad if fsdp2 else OptimizerLoad
        opt_load = load_cls(optimizer, grid, set(saved), frozenset(padding))
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
        _load_scheduler(scheduler, common["scheduler"], path)
    if rng:
        restore_rng(rank, rng)
    comm.barrier(grid.host_group)
    if finetune:
        return LoadedCheckpoint(0, 0, common["args"])
    return LoadedCheckpoint(common["iteration"], common["consumed_samples"], common["args"])
