"""--export-hf-dir: the trained model as a Hugging Face checkpoint that
`transformers.AutoModelForCausalLM.from_pretrained` loads.

    DIR/config.json                         LlamaConfig / MixtralConfig / Qwen2MoeConfig
    DIR/model-0000i-of-0000p.safetensors    pipeline stage i's tensors (one file a stage)
    DIR/model.safetensors.index.json        tensor -> file
    DIR/tokenizer.json, ...                 the tokenizer's files, when the run used a
                                            Hugging Face tokenizer directory

No rank holds the whole model: each stage's tensors are all-gathered over tp (and ep / etp
for experts) within the stage (`pentatron.models.hf.to_hf`), and one rank of the stage
writes its file. Written into a temporary sibling directory, renamed into place when every
file is there, so DIR never holds a partial checkpoint.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from pentatron.models.hf import PER_EXPERT, HFConfigError, config_to_hf_dict, to_hf
from pentatron.models.hf.safetensors_io import INDEX, save_tensors, write_json
from pentatron.models.hf.state_map import EMBED, LM_HEAD
from pentatron.parallel_state import ProcessGrid, comm

from ..arguments_validate import ArgumentError

# The files of a Hugging Face tokenizer directory that travel with the weights.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


def _hf_config_dict(args: argparse.Namespace, config: Any, vocab_size: int) -> dict[str, Any]:
    extras: dict[str, Any] = {}
    if getattr(args, "pretrained_kind", None) == "hf":
        from .config import hf_config

        extras = hf_config(args.pretrained_checkpoint)[3]  # token ids etc. carried back
    return config_to_hf_dict(config, vocab_size, args.max_position_embeddings, extras)


def check_exportable(args: argparse.Namespace) -> None:
    """In flag validation (no collective): DIR is new, and the model has a HF form."""
    from ..training.configs import transformer_config

    out = args.export_hf_dir
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ArgumentError(
            f"--export-hf-dir={out}: exists and is not an empty directory; the rule: an export "
            "never overwrites; fix: choose a new directory"
        )
    if args.use_torch_fsdp2:
        raise ArgumentError(
            f"--export-hf-dir={out}: with --use-torch-fsdp2 the weights are dp shards, which "
            "this export does not gather; fix: pass --save DIR and convert the checkpoint "
            "afterwards: pentatron-convert checkpoint-to-hf --load DIR --out HF_DIR"
        )
    try:
        _hf_config_dict(args, transformer_config(args), vocab_size=1)
    except HFConfigError as e:
        raise ArgumentError(
            f"--export-hf-dir={out}: this model has no Hugging Face Llama / Mixtral / "
            f"Qwen2-MoE / DeepSeek-V3 form: {e}"
        ) from None


def tokenizer_dir(args: argparse.Namespace) -> str | None:
    model = args.tokenizer_model
    if args.tokenizer_type == "HuggingFaceTokenizer" and model and os.path.isdir(model):
        return model
    return None


def copy_tokenizer_files(args: argparse.Namespace, out: str | os.PathLike[str]) -> None:
    """The run's Hugging Face tokenizer files (none for other tokenizers) into `out`."""
    source = tokenizer_dir(args)
    if source is None:
        return
    for f in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(source, f)):
            shutil.copyfile(os.path.join(source, f), os.path.join(out, f))


def export_hf(
    args: argparse.Namespace,
    chunks: Sequence[Any],
    grid: ProcessGrid,
    config: Any,
    vocab_size: int,
) -> str:
    """Collective over the world: write this rank's stage file, then rank 0 the rest."""
    out = os.path.abspath(args.export_hf_dir)
    host = grid.host_group
    box = [""]
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        box = [tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", dir=os.path.dirname(out))]
    dist.broadcast_object_list(box, src=0, group=host)  # a path: gloo, no tensor
    tmp = box[0]
    models = [getattr(c, "module", c) for c in chunks]
    for c in chunks:
        c.finish_param_sync()  # --overlap-param-gather: the last step's params in place
    tensors = to_hf(models, expert_layout=PER_EXPERT)  # collective over tp / ep / etp
    if not config.untie_embeddings_and_output_weights:
        tensors.pop(LM_HEAD, None)  # as save_pretrained: the tied head is not stored
    pp, stage = grid.size("pp"), grid.rank("pp")
    if stage > 0:  # the MTP stage's copy of the embedding: the first stage writes it
        tensors.pop(EMBED, None)
    name = f"model-{stage + 1:05d}-of-{pp:05d}.safetensors"
    writer = all(grid.rank(d) == 0 for d in ("tp", "dp", "cp", "ep"))
    if writer:
        save_tensors({k: v.cpu() for k, v in tensors.items()}, os.path.join(tmp, name))
    maps: list[Any] = [None] * dist.get_world_size(host)
    dist.all_gather_object(maps, dict.fromkeys(tensors, name) if writer else {}, group=host)
    if dist.get_rank() == 0:
        weight_map: dict[str, str] = {}
        for m in maps:
            weight_map.update(m)
        write_json(
            {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))},
            os.path.join(tmp, INDEX),
        )
        write_json(_hf_config_dict(args, config, vocab_size), os.path.join(tmp, "config.json"))
        copy_tokenizer_files(args, tmp)
        if os.path.isdir(out):  # empty (checked in validation)
            os.rmdir(out)
        os.replace(tmp, out)
    comm.barrier(host)
    return out
