"""Offline conversion between a Hugging Face directory and this app's checkpoint folder
(`iter_XXXXXXX/` + `latest_checkpointed_iteration.txt`), one process, no process group.
Registered as `pentatron-convert` subcommands (entry point group `pentatron.convert`):

    pentatron-convert checkpoint-to-hf --load DIR [--ckpt-step N] --out HF_DIR
    pentatron-convert hf-to-checkpoint --hf HF_DIR --save DIR

A checkpoint holds every tensor as its global (layout-free) tensor, so a checkpoint of a
long run at any tp / pp / ep layout converts without knowing that layout, and the result
loads at any layout (`--pretrained-checkpoint`, or `--load` with `--finetune`).

checkpoint-to-hf reads the checkpoint one transformer layer at a time (DCP reads only the
keys asked for) and writes one safetensors file per layer (+ one for the embedding, final
norm and output layer) and the index: memory is one layer, not the model. hf-to-checkpoint
builds the model in one process (memory: the model once) and writes iteration 0 with no
optimizer state. Both write into a temporary sibling and rename it into place.
"""

from __future__ import annotations

import argparse
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from pentatron.models.hf import PER_EXPERT, config_to_hf_dict, full_to_hf
from pentatron.models.hf.safetensors_io import INDEX, atomic_dir, save_tensors, write_json
from pentatron.models.hf.state_map import LM_HEAD
from pentatron.models.sharding import param_sharding, state_tensors

from ..checkpointing import layout
from ..checkpointing.common_state import model_fields, read_common, write_common
from ..checkpointing.model_state import PREFIX
from ..checkpointing.rectangles import VOCAB_PADDING, param_rects, shard_info
from .export import copy_tokenizer_files

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@contextmanager
def _single_process() -> Iterator[None]:
    """DCP in this one process (no_dist): silence its warning that no group exists."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def saved_args_namespace(saved: dict[str, Any]) -> argparse.Namespace:
    """The run's flags (parser defaults, then the saved values) at a one-process layout."""
    from ..arguments import parse_args

    args = parse_args([])
    for key, value in saved.items():
        setattr(args, key, value)
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    args.context_parallel_size = args.expert_model_parallel_size = 1
    args.virtual_pipeline_model_parallel_size = None
    args.expert_tensor_parallel_size = None
    args.decoder_first_pipeline_num_layers = args.decoder_last_pipeline_num_layers = None
    args.pipeline_model_parallel_layout = args.num_virtual_stages_per_pipeline_rank = None
    args.account_for_embedding_in_pipeline_split = False
    args.account_for_loss_in_pipeline_split = False
    args.sequence_parallel = False
    return args


def _group(key: str) -> str:
    """Which output file a checkpoint key goes to: its layer, or the rest."""
    m = _LAYER.match(key[len(PREFIX) :])
    return f"layer {int(m.group(1)):06d}" if m else "outer"


def _full_tensors(loaded: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """Checkpoint keys -> global tensors: gate / up halves joined along their split dim,
    vocabulary padding rows dropped."""
    full: dict[str, torch.Tensor] = {}
    for key in sorted(loaded):
        name = key[len(PREFIX) :]
        if name.endswith(VOCAB_PADDING) or name.endswith("/up"):
            continue
        if name.endswith("/gate"):
            base = name[: -len("/gate")]
            dim = param_sharding(base, config).dim
            full[base] = torch.cat([loaded[key], loaded[PREFIX + base + "/up"]], dim=dim)
        else:
            full[name] = loaded[key]
    return full


def checkpoint_to_hf(load_dir: str, out: str, iteration: int | None = None) -> str:
    """Write the checkpoint at `iteration` (default: the latest) of `load_dir` to `out`."""
    from ..training.configs import transformer_config

    step = layout.read_latest_iteration(load_dir) if iteration is None else iteration
    if step is None:
        raise FileNotFoundError(f"--load {load_dir}: no {layout.TRACKER}; fix: pass --ckpt-step")
    path = layout.iter_dir(load_dir, step)
    common = read_common(path)
    args = saved_args_namespace(common["args"])
    config = transformer_config(args)
    vocab, max_positions = common["model"]["vocab_size"], common["model"]["max_sequence_length"]
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    tensors = {  # the model's tensors (no byte entries)
        k: m
        for k, m in meta.items()
        if k.startswith(PREFIX) and isinstance(m, TensorStorageMetadata)
    }
    keys = sorted(tensors)
    groups = sorted({_group(k) for k in keys})
    weight_map: dict[str, str] = {}
    with atomic_dir(out) as tmp:
        for i, group in enumerate(groups):
            want = {
                k: torch.empty(tuple(t.size), dtype=t.properties.dtype)
                for k, t in tensors.items()
                if _group(k) == group
            }
            with _single_process():
                dcp.load(want, storage_reader=FileSystemReader(path), no_dist=True)
            hf = full_to_hf(_full_tensors(want, config), config, vocab, expert_layout=PER_EXPERT)
            if not config.untie_embeddings_and_output_weights:
                hf.pop(LM_HEAD, None)  # as save_pretrained: the tied head is not stored
            name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            save_tensors(hf, tmp / name, {"format": "pt"})
            weight_map.update(dict.fromkeys(hf, name))
        write_json({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, tmp / INDEX)
        write_json(
            config_to_hf_dict(config, vocab, max_positions, _extras(args)), tmp / "config.json"
        )
        copy_tokenizer_files(args, tmp)
    return out


def _extras(args: argparse.Namespace) -> dict[str, Any]:
    """Token ids etc. of the Hugging Face model the run started from, if it is still there."""
    source = getattr(args, "pretrained_checkpoint", None)
    if getattr(args, "pretrained_kind", None) != "hf" or not source or not os.path.isdir(source):
        return {}
    from .config import hf_config

    return hf_config(source)[3]


def hf_to_checkpoint(hf_dir: str, save_dir: str) -> str:
    """Write `hf_dir`'s weights as iteration 0 of a new checkpoint folder `save_dir`."""
    from pentatron.models.hf import load_hf_checkpoint_shard

    from .config import hf_config, implied_flags

    _, vocab, max_positions, _ = hf_config(hf_dir)
    model = load_hf_checkpoint_shard(hf_dir, make_vocab_size_divisible_by=1)
    info = shard_info(model, 0, 1)
    sd: dict[str, torch.Tensor] = {}
    for name, tensor in state_tensors(model).items():
        for rect in param_rects(name, tuple(tensor.shape), info):
            sd[PREFIX + rect.key] = tensor[rect.local].contiguous()
    args = {**implied_flags(hf_dir), "make_vocab_size_divisible_by": 1}
    with atomic_dir(save_dir) as tmp:
        path = layout.iter_dir(str(tmp), 0)
        with _single_process():
            dcp.save(sd, storage_writer=FileSystemWriter(path), no_dist=True)
        chunk = SimpleNamespace(vocab_size=vocab, max_sequence_length=max_positions)
        write_common(
            path,
            {
                "iteration": 0,
                "consumed_samples": 0,
                "args": args,
                "model": model_fields(model.config, chunk),
                "layout": {
                    "world_size": 1,
                    "tp": 1,
                    "pp": 1,
                    "dp": 1,
                    "cp": 1,
                    "ep": 1,
                    "vpp": None,
                },
                "has_optimizer": False,
                "scheduler": None,
                "param_groups": [],
                "grad_scaler": None,
            },
        )
        layout.write_latest_iteration(str(tmp), 0)
    return save_dir


def register(sub: Any) -> None:
    """Add this module's subcommands to `pentatron-convert`'s subparsers."""
    a = sub.add_parser("checkpoint-to-hf", help="training-app checkpoint -> HF safetensors dir")
    a.add_argument("--load", required=True, help="the app's --save folder")
    a.add_argument("--ckpt-step", type=int, default=None, help="this iteration, not the latest")
    a.add_argument("--out", required=True, help="new output directory")
    a.set_defaults(run=lambda ns: checkpoint_to_hf(ns.load, ns.out, ns.ckpt_step))
    b = sub.add_parser("hf-to-checkpoint", help="HF safetensors dir -> training-app checkpoint")
    b.add_argument("--hf", required=True, help="HF checkpoint directory")
    b.add_argument("--save", required=True, help="new checkpoint folder (iteration 0)")
    b.set_defaults(run=lambda ns: hf_to_checkpoint(ns.hf, ns.save))
