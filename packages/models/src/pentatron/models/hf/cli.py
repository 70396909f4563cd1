"""`pentatron-convert`: Hugging Face Llama / Mixtral / Qwen2-MoE checkpoint <-> Pentatron.

    pentatron-convert hf-to-pentatron --hf DIR --out DIR --tp N --pp N [--ep N]
    pentatron-convert pentatron-to-hf --ckpt DIR --out DIR

Installed packages may add subcommands (entry point group `pentatron.convert`): with
pentatron-pretrain, `checkpoint-to-hf` / `hf-to-checkpoint` for the training app's folders.

Pentatron checkpoint (format "pentatron-gpt", version 1): `config.json` (every
TransformerConfig field, plus vocab_size, max_seq_len, make_vocab_size_divisible_by, tp,
pp, ep, format, version, hf_extras) and one `tp{t:02d}_pp{p:03d}.safetensors` per (tp, pp)
rank (`tp{t:02d}_pp{p:03d}_ep{e:03d}` per (tp, pp, ep) rank when ep > 1; expert tp = tp)
holding that rank's GPTModel state dict (local layer names, exactly what
`model.load_state_dict` takes; MoE models at tp > 1 are written with sequence_parallel=True,
which Megatron's MoE needs and which changes no tensor). Each rank file is built from slices of the HF files, one
rank at a time; the HF side is written one pipeline stage per file (+ index when pp > 1).
Outputs are written to a temporary directory and moved into place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from ..config import RopeScaling, TransformerConfig
from ..sharding import global_param_name, merge_shards, param_sharding
from ..transformer_block import get_layer_offset
from .config_map import config_from_hf, config_to_hf_dict
from .convert import hf_shard_state_dict
from .moe_map import PER_EXPERT
from .safetensors_io import (
    INDEX,
    SafetensorsDirSource,
    atomic_dir,
    read_json,
    save_tensors,
    write_json,
)
from .state_map import LM_HEAD, full_to_hf

FORMAT, VERSION = "pentatron-gpt", 1


def rank_file(tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> str:
    ep = "" if ep_rank is None else f"_ep{ep_rank:03d}"
    return f"tp{tp_rank:02d}_pp{pp_rank:03d}{ep}.safetensors"


def config_to_json(config: TransformerConfig) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        if isinstance(v, torch.dtype):
            v = str(v).replace("torch.", "")
        elif isinstance(v, RopeScaling):
            v = dataclasses.asdict(v)
        out[f.name] = v
    return out


def config_from_json(d: dict[str, Any]) -> TransformerConfig:
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    kw = {k: v for k, v in d.items() if k in names}
    kw["params_dtype"] = getattr(torch, kw.get("params_dtype", "float32"))
    return TransformerConfig(**kw)


def hf_to_pentatron(
    hf_dir: str, out: str, tp: int = 1, pp: int = 1, divisible_by: int = 128, ep: int = 1
) -> None:
    hf_config = read_json(Path(hf_dir) / "config.json")
    moe = config_from_hf(hf_config)[0].is_moe  # at one rank: no layout rule applies yet
    overrides: dict[str, Any] = {"sequence_parallel": True} if moe and tp > 1 else {}
    config, vocab, max_seq, extras = config_from_hf(
        hf_config,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        **overrides,
    )
    meta = {
        **config_to_json(config),
        "format": FORMAT,
        "version": VERSION,
        "vocab_size": vocab,
        "max_seq_len": max_seq,
        "make_vocab_size_divisible_by": divisible_by,
        "tp": tp,
        "pp": pp,
        "ep": ep,
        "hf_extras": extras,
    }
    with SafetensorsDirSource(hf_dir) as src, atomic_dir(out) as tmp:
        for p in range(pp):
            for e in range(ep):
                for t in range(tp):
                    sd = hf_shard_state_dict(
                        src,
                        config,
                        vocab,
                        tp_rank=t,
                        pp_rank=p,
                        ep_rank=e,
                        make_vocab_size_divisible_by=divisible_by,
                    )
                    offset = get_layer_offset(config, p)
                    meta_r = {"tp_rank": t, "pp_rank": p, "ep_rank": e, "layer_offset": offset}
                    save_tensors(sd, tmp / rank_file(t, p, e if ep > 1 else None), meta_r)
        write_json(meta, tmp / "config.json")


def _merge_stage(ckpt: str, config: TransformerConfig, p: int, tp: int, ep: int) -> dict:
    """Full tensors (global names) of stage p: tp shards merged; expert tensors from every
    (ep, etp = tp) rank, ep-major; the others from ep rank 0 (they are replicated over ep)."""
    from safetensors.torch import load_file

    def load(t: int, e: int) -> dict:
        return load_file(str(Path(ckpt) / rank_file(t, p, e if ep > 1 else None)))

    shards = [[load(t, e) for t in range(tp)] for e in range(ep)]
    offset, full = get_layer_offset(config, p), {}
    for n in shards[0][0]:
        if param_sharding(n, config).expert:
            parts = [shards[e][t][n] for e in range(ep) for t in range(tp)]
            merged = merge_shards(n, parts, config=config, ep_size=ep)
        else:
            merged = merge_shards(n, [s[n] for s in shards[0]], config=config)
        full[global_param_name(n, offset)] = merged
    return full


def pentatron_to_hf(ckpt: str, out: str) -> None:
    """MoE experts are written one tensor per expert, as `save_pretrained` does."""
    meta = read_json(Path(ckpt) / "config.json")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{ckpt}/config.json: format={meta.get('format')!r}, expected {FORMAT!r}")
    config = config_from_json(meta)
    vocab, tp, pp, ep = meta["vocab_size"], meta["tp"], meta["pp"], meta.get("ep", 1)
    hf_cfg = config_to_hf_dict(config, vocab, meta["max_seq_len"], meta.get("hf_extras"))
    tied = hf_cfg["tie_word_embeddings"]
    weight_map: dict[str, str] = {}
    with atomic_dir(out) as tmp:
        for p in range(pp):
            full = _merge_stage(ckpt, config, p, tp, ep)
            hf = full_to_hf(full, config, vocab, expert_layout=PER_EXPERT)
            if tied:
                hf.pop(LM_HEAD, None)  # as save_pretrained: the tied head is not stored
            if p != 0:
                hf = {k: v for k, v in hf.items() if k not in weight_map}
            name = "model.safetensors" if pp == 1 else f"model-{p + 1:05d}-of-{pp:05d}.safetensors"
            save_tensors(hf, tmp / name, {"format": "pt"})
            weight_map.update(dict.fromkeys(hf, name))
        if pp > 1:
            write_json({"metadata": {}, "weight_map": weight_map}, tmp / INDEX)
        write_json(hf_cfg, tmp / "config.json")


PLUGIN_GROUP = "pentatron.convert"


def _plugins() -> list[Any]:
    """Subcommands other installed packages add (entry points of group `pentatron.convert`,
    each `register(subparsers)`): the training app adds its checkpoint folder's conversions."""
    from importlib.metadata import entry_points

    return [ep.load() for ep in entry_points(group=PLUGIN_GROUP)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pentatron-convert", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-pentatron", help="HF safetensors dir -> Pentatron checkpoint")
    a.add_argument(
        "--hf", required=True, help="HF checkpoint directory (config.json + safetensors)"
    )
    a.add_argument("--out", required=True, help="new output directory")
    a.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    a.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    a.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    a.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    b = sub.add_parser("pentatron-to-hf", help="Pentatron checkpoint -> HF safetensors dir")
    b.add_argument("--ckpt", required=True, help="Pentatron checkpoint directory")
    b.add_argument("--out", required=True, help="new output directory")
    for plugin in _plugins():
        plugin(sub)
    args = parser.parse_args(argv)
    if hasattr(args, "run"):  # a plugin's subcommand: returns what it wrote
        out = args.run(args)
    elif args.command == "hf-to-pentatron":
        hf_to_pentatron(
            args.hf, args.out, args.tp, args.pp, args.make_vocab_size_divisible_by, args.ep
        )
        out = args.out
    else:
        pentatron_to_hf(args.ckpt, args.out)
        out = args.out
    print(json.dumps({"command": args.command, "out": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
