"""--pretrained-checkpoint from a Hugging Face directory: model weights only, at any tp / pp /
vpp / ep / etp / cp / dp layout, with or without FSDP2.

Each rank reads from the safetensors files only the rows or columns of its tp shard (and
of its experts) of the layers its chunks hold (`safe_open(...).get_slice`); with FSDP2 it
then keeps the rows of the shard it holds. The vocabulary padding rows start at zero. The
optimizer's fp32 main params are refreshed from the loaded weights; optimizer state and
the schedule start fresh (iteration 0), as Megatron's --finetune.

`missing_tensors` runs in flag validation, on every rank alike, so a partial checkpoint
fails before any collective with the names it lacks.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from pentatron.models.hf import FUSED, PER_EXPERT, SafetensorsDirSource, held, read_param_shard
from pentatron.models.hf.state_map import hf_keys_expected
from pentatron.models.sharding import state_tensors
from pentatron.optim import FSDP2DataParallel, FSDP2Optimizer, local_tensor

from .config import PretrainedConfigError


def missing_tensors(path: str, config: Any) -> list[str]:
    """The tensors a model of `config` reads that the safetensors files in `path` lack (MoE:
    against the expert layout, fused or per expert, that fits the files best; gpt-oss's
    expert weights may be stored in MXFP4)."""
    with SafetensorsDirSource(path) as src:
        have = src.keys()
    layouts = (PER_EXPERT, FUSED) if config.is_moe else (PER_EXPERT,)
    misses = [[k for k in hf_keys_expected(config, lay) if not held(k, have)] for lay in layouts]
    return min(misses, key=len)


def check_complete(path: str, config: Any) -> None:
    missing = missing_tensors(path, config)
    if missing:
        shown = ", ".join(missing[:20]) + (
            f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        )
        raise PretrainedConfigError(
            f"--pretrained-checkpoint {path}: the safetensors files lack {len(missing)} tensors "
            f"the model needs: {shown}; fix: copy the complete checkpoint (every file of "
            "model.safetensors.index.json)"
        )


@torch.no_grad()
def load_hf_weights(path: str | os.PathLike, chunks: Sequence[Any], optimizer: Any) -> None:
    """Fill every parameter (and persistent buffer) of this rank's `chunks` from `path`."""
    with SafetensorsDirSource(path) as src:
        for chunk in chunks:
            model = getattr(chunk, "module", chunk)
            fsdp2 = isinstance(chunk, FSDP2DataParallel)
            params = {id(p) for p in model.parameters()}
            for local, tensor in state_tensors(model, keep_vars=True).items():
                part = read_param_shard(model, local, src)
                if fsdp2 and id(tensor) in params:  # this rank holds rows [lo, hi) of the shard
                    lo, hi = chunk.held_rows(tensor)
                    part = part[lo:hi]
                target = local_tensor(tensor.data)
                if part.shape != target.shape:
                    raise PretrainedConfigError(
                        f"--pretrained-checkpoint {path}: {local} reads as "
                        f"{tuple(part.shape)}, this rank holds {tuple(target.shape)}; fix: "
                        "check config.json against the safetensors files"
                    )
                target.copy_(part)
    if optimizer is not None and not isinstance(optimizer, FSDP2Optimizer):
        from ..checkpointing.optimizer_state import refresh_main_from_model

        refresh_main_from_model(optimizer)  # FSDP2's params are its main params
