"""`from_hf`, `to_hf` and the sharded load of a Hugging Face Llama / Mixtral / Qwen2-MoE
checkpoint (MoE: experts split over ep and etp, see `moe_map`).

    from_hf(hf_model) -> GPTModel          every parameter copied from the HF tensors
    to_hf(model) -> {hf_name: tensor}      tp shards all-gathered (tp group), padding dropped;
                                           gather_pipeline=True: every stage's part, everywhere
    load_hf_checkpoint_shard(dir, grid)    this rank's chunk, reading only its slices
    hf_shard_state_dict(source, ...)       the same tensors for any (tp, pp, ep) rank, no groups

Pipeline parallelism: each chunk maps only its own layers (global indices), the first stage
the embedding, the last stage the final norm and output layer. `to_hf` of a pipeline rank
returns that rank's part of the HF state dict; the parts of all stages are disjoint (tied
`lm_head.weight` may come from both ends with equal values), so the full dict is their
union (`pentatron-to-hf` builds it from the per-rank files).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pentatron.parallel_state import (
    ProcessGrid,
    comm,
    get_default_grid,
    model_parallel_is_initialized,
)
from pentatron.tp_layers import pad_vocab_size

from ..config import TransformerConfig
from ..gpt_model import GPTModel
from ..layer_specs import get_gpt_layer_local_spec
from ..sharding import global_param_name, merge_shards, param_sharding, state_tensors
from ..transformer_block import get_layer_offset, get_num_layers_to_build
from .config_map import config_from_hf
from .moe_map import default_expert_layout
from .safetensors_io import SafetensorsDirSource, read_json
from .state_map import DictSource, TensorSource, chunk_param_names, full_to_hf, read_shard


def _grid(grid: ProcessGrid | None) -> ProcessGrid | None:
    if grid is None and model_parallel_is_initialized():
        return get_default_grid()
    return grid


def _sizes(grid: ProcessGrid | None) -> dict[str, Any]:
    if grid is None:
        return {}
    return {
        "tensor_model_parallel_size": grid.size("tp"),
        "pipeline_model_parallel_size": grid.size("pp"),
        "virtual_pipeline_model_parallel_size": grid.layout.vpp,
        "expert_model_parallel_size": grid.size("ep"),
        "expert_tensor_parallel_size": grid.size("etp"),
    }


def read_param_shard(model: GPTModel, local: str, src: TensorSource) -> torch.Tensor:
    """This rank's tp (and ep / etp) shard of `model`'s tensor `local`, read from `src`."""
    par = model.parallel
    return read_shard(
        global_param_name(local, model.layer_offset),
        src,
        model.config,
        tp_rank=par.tp_rank,
        tp_size=par.tp_size,
        vocab_size=model.vocab_size,
        padded_vocab_size=model.padded_vocab_size,
        ep_rank=par.rank("ep"),
        ep_size=par.ep_size,
        etp_rank=par.rank("etp"),
        etp_size=par.etp_size,
    )


@torch.no_grad()
def load_from_source(model: GPTModel, src: TensorSource) -> None:
    """Fill every parameter of `model` (one chunk, any tp rank) from HF tensors in `src`."""
    for local, param in state_tensors(model, keep_vars=True).items():
        part = read_param_shard(model, local, src)
        if part.shape != param.shape:
            raise ValueError(
                f"{local}: the Hugging Face tensors give shape {tuple(part.shape)}, the model "
                f"has {tuple(param.shape)}; fix: check config.json against the checkpoint"
            )
        param.copy_(part)


def _build(
    config: TransformerConfig,
    vocab_size: int,
    max_seq_len: int,
    grid: ProcessGrid | None,
    vp_stage: int | None,
    spec: Any,
    make_vocab_size_divisible_by: int,
) -> GPTModel:
    return GPTModel(
        config,
        spec or get_gpt_layer_local_spec(config.qk_layernorm, config.multi_latent_attention),
        vocab_size,
        max_seq_len,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        grid=grid,
        vp_stage=vp_stage,
    )


def from_hf(
    hf: Any,
    hf_config: Any = None,
    *,
    grid: ProcessGrid | None = None,
    vp_stage: int | None = None,
    spec: Any = None,
    make_vocab_size_divisible_by: int = 128,
    params_dtype: torch.dtype | None = None,
    **config_overrides: Any,
) -> GPTModel:
    """A GPTModel with the weights of `hf` (a LlamaForCausalLM / MixtralForCausalLM /
    Qwen2MoeForCausalLM, or its state dict + config; experts in either layout).

    Single process by default; with `grid` (or a default grid) it builds this rank's chunk
    from the in-memory HF tensors (every rank then holds the HF model: use
    `load_hf_checkpoint_shard` to avoid that). `config_overrides` go to `config_from_hf`.
    """
    if isinstance(hf, dict):
        if hf_config is None:
            raise ValueError("from_hf(state_dict) needs hf_config (a LlamaConfig or its dict)")
        state_dict = hf
    else:
        hf_config = hf.config if hf_config is None else hf_config
        state_dict = hf.state_dict()
    grid = _grid(grid)
    config, vocab, max_seq, _ = config_from_hf(
        hf_config, params_dtype=params_dtype, **_sizes(grid), **config_overrides
    )
    model = _build(config, vocab, max_seq, grid, vp_stage, spec, make_vocab_size_divisible_by)
    load_from_source(model, DictSource(state_dict))
    return model


def load_hf_checkpoint_shard(
    path: str | os.PathLike,
    grid: ProcessGrid | None = None,
    *,
    vp_stage: int | None = None,
    spec: Any = None,
    make_vocab_size_divisible_by: int = 128,
    params_dtype: torch.dtype | None = None,
    **config_overrides: Any,
) -> GPTModel:
    """This rank's GPTModel chunk from a HF safetensors directory (config.json + weights).

    Reads only the tensors of this chunk's layers and, of those, only this tp rank's rows or
    columns (MoE: only this ep rank's experts, and of each this etp rank's slice) (`safe_open(...).get_slice`); no rank materialises the full model. The layout
    comes from `grid` (None: the default grid, else one process). With vpp, call once per
    `vp_stage`. transformers is not needed.
    """
    grid = _grid(grid)
    hf_config = read_json(os.path.join(path, "config.json"))
    config, vocab, max_seq, _ = config_from_hf(
        hf_config, params_dtype=params_dtype, **_sizes(grid), **config_overrides
    )
    model = _build(config, vocab, max_seq, grid, vp_stage, spec, make_vocab_size_divisible_by)
    with SafetensorsDirSource(path) as src:
        load_from_source(model, src)
    return model


def stage_flags(config: TransformerConfig, pp_rank: int, vp_stage: int | None) -> tuple[bool, bool]:
    """(pre_process, post_process) of chunk `vp_stage` of pipeline rank `pp_rank`: the first
    and the last virtual stage of the config's placement (loop or V)."""
    layout = config.stage_layout()
    stage = layout.stage(pp_rank, vp_stage or 0)
    return stage == 0, stage == layout.pp * layout.chunks - 1


def hf_shard_state_dict(
    src: TensorSource,
    config: TransformerConfig,
    vocab_size: int,
    *,
    tp_rank: int,
    pp_rank: int,
    vp_stage: int | None = None,
    make_vocab_size_divisible_by: int = 128,
    ep_rank: int = 0,
    etp_rank: int | None = None,
) -> dict[str, torch.Tensor]:
    """The state dict (local names) of GPTModel chunk (tp_rank, pp_rank, vp_stage, ep_rank,
    etp_rank (default: tp_rank)) of `config`'s layout, read from HF tensors; needs no
    process group (used by the CLI)."""
    tp = config.tensor_model_parallel_size
    padded = pad_vocab_size(vocab_size, tp, make_vocab_size_divisible_by)
    pre, post = stage_flags(config, pp_rank, vp_stage)
    offset = get_layer_offset(config, pp_rank, vp_stage)
    names = chunk_param_names(
        config,
        pre_process=pre,
        post_process=post,
        layer_offset=offset,
        num_layers=get_num_layers_to_build(config, pp_rank, vp_stage),
        mtp=config.mtp_on(pp_rank, vp_stage, post),
        final_norm=config.final_norm_on(pp_rank, vp_stage, post),
    )
    out = {}
    for local in names:
        out[local] = read_shard(
            global_param_name(local, offset),
            src,
            config,
            tp_rank=tp_rank,
            tp_size=tp,
            vocab_size=vocab_size,
            padded_vocab_size=padded,
            ep_rank=ep_rank,
            ep_size=config.expert_model_parallel_size,
            etp_rank=etp_rank,
            etp_size=config.expert_tp_size,
        ).clone()
    return out


def _all_gather(t: torch.Tensor, size: int, group: Any) -> list[torch.Tensor]:
    shards = [torch.empty_like(t) for _ in range(size)]
    comm.all_gather(shards, t.contiguous(), group=group)
    return shards


def _gather_tp(name: str, t: torch.Tensor, model: GPTModel) -> torch.Tensor:
    """tp shards -> full; expert tensors: etp shards -> all-gather(etp), then the ep ranks'
    experts -> all-gather(ep) -> `[E, ...]`."""
    par = model.parallel
    if param_sharding(name, model.config).expert:
        if par.etp_size > 1:
            etp_shards = _all_gather(t, par.etp_size, par.group("etp"))
            t = merge_shards(name, etp_shards, config=model.config)
        if par.ep_size > 1:
            t = torch.cat(_all_gather(t, par.ep_size, par.group("ep")), dim=0)
        return t
    if par.tp_size == 1:
        return t
    shards = [torch.empty_like(t) for _ in range(par.tp_size)]
    comm.all_gather(shards, t.contiguous(), group=par.tp_group)
    return merge_shards(name, shards, config=model.config)


@torch.no_grad()
def to_hf(
    model: GPTModel | list[GPTModel],
    *,
    gather_pipeline: bool = False,
    expert_layout: str | None = None,
) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict of `model` (a chunk, or this rank's list of chunks).

    Tensor-parallel shards are all-gathered over tp (`[.../t]` -> all-gather(tp) -> full),
    so every tp rank returns the same dict. With pp > 1 it holds this rank's layers only
    (see the module docstring), unless `gather_pipeline`: then every stage's tensors are
    broadcast over the pp group and every rank returns the whole dict (a collective over
    pp; memory: the full model on every rank). Tied embeddings give `lm_head.weight` equal
    to `model.embed_tokens.weight`, as `LlamaForCausalLM.state_dict()` does. MoE experts
    are all-gathered over etp and ep and written in `expert_layout` ("fused": transformers
    >= 5 in memory; "per_expert": transformers 4 and checkpoint files; None: the installed
    transformers', so `hf_model.load_state_dict(to_hf(model))` works).
    """
    layout = expert_layout or default_expert_layout()
    chunks = model if isinstance(model, (list, tuple)) else [model]
    out: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        full = {
            global_param_name(local, chunk.layer_offset): _gather_tp(local, t, chunk)
            for local, t in state_tensors(chunk).items()
        }
        out.update(full_to_hf(full, chunk.config, chunk.vocab_size, expert_layout=layout))
    par = chunks[0].parallel
    if gather_pipeline and par.pp_size > 1:
        out = _gather_pipeline(out, par.grid)
    return out


def _broadcast_tensor(
    t: torch.Tensor | None, src: int, group: Any, dtype, shape, device: torch.device
) -> torch.Tensor:
    """`t` from `src` (None elsewhere: received into a `shape` buffer), on `device`."""
    buf = (
        t.to(device).contiguous()
        if t is not None
        else torch.empty(shape, dtype=dtype, device=device)
    )
    comm.broadcast(buf, src=src, group=group)
    return buf


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _gather_pipeline(mine: dict[str, torch.Tensor], grid: ProcessGrid) -> dict[str, torch.Tensor]:
    """The union of every pp stage's dict, on every stage (tensors only, no pickling).

    Per stage in turn: a header (count), then per tensor its name as uint8, its dtype code,
    ndim and shape as int64, and the data; every buffer on the grid's device (the pp group
    may be NCCL's)."""
    group, me, device = grid.group("pp"), grid.rank("pp"), grid.device

    def bcast(t: torch.Tensor | None, src: int, dtype, shape) -> torch.Tensor:
        return _broadcast_tensor(t, src, group, dtype, shape, device)

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    out: dict[str, torch.Tensor] = {}
    for stage, src in enumerate(grid.ranks("pp")):
        sending = stage == me
        items = list(mine.items()) if sending else []
        count = bcast(ints([len(items)]) if sending else None, src, torch.int64, (1,))
        for i in range(int(count)):
            # name and t are set exactly on the sending stage
            name, t = items[i] if sending else (None, None)
            raw = ints(list(name.encode())) if name is not None else None
            n = bcast(ints([raw.numel()]) if raw is not None else None, src, torch.int64, (1,))
            raw = bcast(
                raw.to(torch.uint8) if raw is not None else None, src, torch.uint8, (int(n),)
            )
            meta = ints([_DTYPES.index(t.dtype), t.dim(), *t.shape]) if t is not None else None
            head = bcast(meta[:2] if meta is not None else None, src, torch.int64, (2,))
            dtype, ndim = _DTYPES[int(head[0])], int(head[1])
            shape = bcast(meta[2:] if meta is not None else None, src, torch.int64, (ndim,))
            data = bcast(t, src, dtype, tuple(int(d) for d in shape))
            out[bytes(raw.tolist()).decode()] = t if t is not None else data
    return out
