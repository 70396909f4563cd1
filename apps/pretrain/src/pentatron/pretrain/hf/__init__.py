"""Hugging Face in and out of the training app.

    --pretrained-checkpoint DIR   start from a `save_pretrained` directory (or a checkpoint
                                  of this app) when --load holds none: weights only, any
                                  layout, each rank reading its slices (`load`)
    --use-checkpoint-args         model flags not given come from its config.json (`config`)
    --export-hf-dir DIR           after training, a directory `from_pretrained` loads
                                  (`export`)

Modules: `config` (flags <-> config.json, checked before any collective), `load`, `export`.
"""

from .config import PretrainedConfigError, check_against_hf, implied_flags, resolve_pretrained
from .export import check_exportable, export_hf
from .load import check_complete, load_hf_weights, missing_tensors

__all__ = [
    "PretrainedConfigError",
    "check_against_hf",
    "check_complete",
    "check_exportable",
    "export_hf",
    "implied_flags",
    "load_hf_weights",
    "missing_tensors",
    "resolve_pretrained",
]
