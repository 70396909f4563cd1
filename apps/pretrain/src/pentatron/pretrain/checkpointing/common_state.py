"""`common.json`: what every rank shares, written by global rank 0 next to the DCP files.

    {"format_version", "iteration", "consumed_samples", "args", "model" (the config fields
     that fix tensor shapes, plus vocab_size and max_sequence_length), "layout" (world size,
     tp / pp / dp / cp / ep / vpp), "scheduler", "param_groups", "grad_scaler"}

Plain JSON (no pickle); `check_model` compares the model fields on load.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch.distributed as dist

from pentatron.parallel_state import ProcessGrid

FORMAT_VERSION = 1
FILE = "common.json"
MODEL_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "gated_linear_unit",
    "activation",
    "normalization",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "position_embedding_type",
    "untie_embeddings_and_output_weights",
    "num_moe_experts",
)


# Fields that add or drop tensors without changing the shape of the others: a difference
# shows as missing / unexpected keys, which --dist-ckpt-strictness decides (Megatron's rule).
PRESENCE_FIELDS = frozenset(
    {"add_bias_linear", "add_qkv_bias", "qk_layernorm", "untie_embeddings_and_output_weights"}
)


class IncompatibleCheckpointError(ValueError):
    """The checkpoint was saved from a model of another shape (the message names the field)."""


def model_fields(config: Any, chunk: Any) -> dict[str, Any]:
    """The fields of `config` (and the chunk's vocabulary) that fix the global tensors."""
    model = getattr(chunk, "module", chunk)
    out = {f: getattr(config, f) for f in MODEL_FIELDS if hasattr(config, f)}
    out["vocab_size"] = model.vocab_size
    out["max_sequence_length"] = model.max_sequence_length
    return {
        k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
        for k, v in out.items()
    }


def layout(grid: ProcessGrid, config: Any) -> dict[str, Any]:
    sizes = {name: grid.size(name) for name in ("tp", "pp", "dp", "cp", "ep")}
    return {
        "world_size": dist.get_world_size(),
        **sizes,
        "vpp": config.virtual_pipeline_model_parallel_size,
    }


def check_model(saved: dict[str, Any], current: dict[str, Any], path: str) -> None:
    """Raise `IncompatibleCheckpointError` naming the first field that differs (the
    PRESENCE_FIELDS aside: their tensors are checked key by key)."""
    for name in sorted((set(saved) | set(current)) - PRESENCE_FIELDS):
        if saved.get(name) != current.get(name):
            raise IncompatibleCheckpointError(
                f"incompatible model: checkpoint {path} has {name}={saved.get(name)!r}, this "
                f"model {name}={current.get(name)!r}; the rule: only the parallel layout may "
                "differ between save and load; fix: load it into a model of the saved config"
            )


def write_common(path: str, state: dict[str, Any]) -> None:
    with open(os.path.join(path, FILE), "w") as f:
        json.dump({"format_version": FORMAT_VERSION, **state}, f, indent=1, sort_keys=True)


def read_common(path: str) -> dict[str, Any]:
    with open(os.path.join(path, FILE)) as f:
        state = json.load(f)
    if state.get("format_version") != FORMAT_VERSION:
        raise IncompatibleCheckpointError(
            f"{path}: format_version {state.get('format_version')}, this code reads "
            f"{FORMAT_VERSION}; fix: load it with the version that saved it"
        )
    return state
