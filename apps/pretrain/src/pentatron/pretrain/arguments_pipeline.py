"""How the layers split over the pipeline, from Megatron-LM's flags; fills in
virtual_pipeline_model_parallel_size (None for one stage per rank).

Four ways, as in Megatron-LM, checked against each other before any collective:
- even: `--num-layers` over pp ranks (x vpp stages), with `--account-for-embedding-in-
  pipeline-split` / `--account-for-loss-in-pipeline-split` counting the embedding / the
  loss as a layer of the first / last stage;
- `--num-layers-per-virtual-pipeline-stage` or `--num-virtual-stages-per-pipeline-rank`
  (or our `--virtual-pipeline-model-parallel-size`) for interleaving;
- uneven: `--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`;
- custom: `--pipeline-model-parallel-layout` places every layer and sets the virtual stages
  (pentatron.pipeline.PipelineLayout).
"""

from __future__ import annotations

import argparse

from pentatron.pipeline import PipelineConfigError, PipelineLayout

from .arguments_validate import ArgumentError, _fail

_VPP_FLAGS = (
    "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank",
    "pipeline_model_parallel_layout",
)
_SPLIT_FLAGS = (
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


def _flag(dest: str) -> str:
    return dest.replace("_", "-")


def virtual_stages(args: argparse.Namespace) -> None:
    """Check the split flags and set args.virtual_pipeline_model_parallel_size."""
    given = [d for d in _VPP_FLAGS if getattr(args, d) is not None]
    if len(given) > 1:
        _fail(
            _flag(given[1]),
            getattr(args, given[1]),
            f"exclusive with --{_flag(given[0])} (Megatron-LM: each one sets the virtual stages)",
            "pass one of them",
        )
    if args.pipeline_model_parallel_layout is not None:
        _set_vpp(args, _custom_layout(args), "pipeline-model-parallel-layout")
        return
    if args.num_layers_per_virtual_pipeline_stage is not None:
        _set_vpp(args, _per_virtual_stage(args), "num-layers-per-virtual-pipeline-stage")
    elif args.num_virtual_stages_per_pipeline_rank is not None:
        _needs_pp("num-virtual-stages-per-pipeline-rank", args)
        _set_vpp(
            args, args.num_virtual_stages_per_pipeline_rank, "num-virtual-stages-per-pipeline-rank"
        )
    if args.virtual_pipeline_model_parallel_size == 1:
        args.virtual_pipeline_model_parallel_size = None
    _split(args)


def _needs_pp(flag: str, args: argparse.Namespace) -> None:
    if args.pipeline_model_parallel_size == 1:
        _fail(
            flag,
            getattr(args, flag.replace("-", "_")),
            "virtual stages need --pipeline-model-parallel-size > 1",
            "drop the flag or set pp > 1",
        )


def _slots(args: argparse.Namespace) -> tuple[int, str]:
    """Layers of the even split, counting the embedding / loss slots, and how to say so."""
    emb, loss = (
        args.account_for_embedding_in_pipeline_split,
        args.account_for_loss_in_pipeline_split,
    )
    extra = " (+1 embedding)" * emb + " (+1 loss)" * loss
    return args.num_layers + emb + loss, extra


def _per_virtual_stage(args: argparse.Namespace) -> int:
    per_v, pp = args.num_layers_per_virtual_pipeline_stage, args.pipeline_model_parallel_size
    _needs_pp("num-layers-per-virtual-pipeline-stage", args)
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if first is not None or last is not None:
        _fail(
            "num-layers-per-virtual-pipeline-stage",
            per_v,
            "an uneven split takes the virtual stages as a count per rank (Megatron-LM)",
            "pass --num-virtual-stages-per-pipeline-rank instead",
        )
    slots, extra = _slots(args)
    if slots % (pp * per_v):
        _fail(
            "num-layers-per-virtual-pipeline-stage",
            per_v,
            f"--num-layers {args.num_layers}{extra} = {slots} must be divisible by pp*{per_v} "
            f"= {pp * per_v}",
            "change the layers per virtual stage or the number of layers",
        )
    return slots // (pp * per_v)


def _set_vpp(args: argparse.Namespace, vpp: int | None, source: str) -> None:
    given = args.virtual_pipeline_model_parallel_size
    if given is not None and given != (vpp or 1):
        _fail(
            "virtual-pipeline-model-parallel-size",
            given,
            f"disagrees with --{source} ({vpp or 1} stages per rank)",
            "pass only one of them",
        )
    args.virtual_pipeline_model_parallel_size = vpp if vpp and vpp > 1 else None


def _split(args: argparse.Namespace) -> None:
    """Even or uneven (first/last) split, and the embedding / loss slots."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    vpp = args.virtual_pipeline_model_parallel_size or 1
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    accounts = [
        d
        for d in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
        if getattr(args, d)
    ]
    if accounts and (first is not None or last is not None):
        _fail(
            _flag(accounts[0]),
            True,
            "an uneven split (--decoder-first/last-pipeline-num-layers) already says where "
            "the layers go (Megatron-LM)",
            "use one of the two ways",
        )
    if first is not None or last is not None:
        return  # the model config checks the uneven split (pentatron.pipeline.StageLayout)
    slots, extra = _slots(args)
    if slots % (pp * vpp):
        _fail(
            "num-layers",
            layers,
            f"{slots} layers{extra} must be divisible by pp*vpp = {pp}*{vpp} for an even split",
            "change --num-layers, or set --decoder-first/last-pipeline-num-layers or "
            "--pipeline-model-parallel-layout",
        )
    if accounts and pp == 1:
        _fail(
            _flag(accounts[0]),
            True,
            "with pp=1 the one stage holds everything",
            f"drop --{_flag(accounts[0])} or set --pipeline-model-parallel-size > 1",
        )


# the layout's messages name library fields; say them as the flags a user typed
_FLAG_WORDS = (
    ("pipeline_model_parallel_layout=", "--pipeline-model-parallel-layout="),
    ("pipeline_model_parallel_size=", "--pipeline-model-parallel-size "),
    ("mtp_num_layers=", "--mtp-num-layers "),
    ("num_layers=", "--num-layers "),
)


def _custom_layout(args: argparse.Namespace) -> int:
    text, pp = args.pipeline_model_parallel_layout, args.pipeline_model_parallel_size
    for dest in _SPLIT_FLAGS:
        value = getattr(args, dest)
        if value not in (None, False):
            _fail(
                _flag(dest),
                value,
                "--pipeline-model-parallel-layout already places every layer (Megatron-LM)",
                f"drop --{_flag(dest)} or the layout",
            )
    try:
        layout = PipelineLayout.parse(text, pp)
        layout.check(args.num_layers, args.mtp_num_layers)
    except PipelineConfigError as exc:
        message = str(exc)
        for field, flag in _FLAG_WORDS:
            message = message.replace(field, flag)
        raise ArgumentError(message) from None
    if layout.mtp_standalone and not args.untie_embeddings_and_output_weights:
        _fail(
            "pipeline-model-parallel-layout",
            text,
            "a standalone MTP stage (its m's in a stage before L's) with tied embeddings would "
            "hold a third copy of the embedding",
            "add --untie-embeddings-and-output-weights (as DeepSeek-V3), or move the m's into "
            "the last stage",
        )
    if pp == 1 and layout.vpp > 1:
        _fail(
            "pipeline-model-parallel-layout",
            text,
            f"{layout.vpp} stages need --pipeline-model-parallel-size > 1 (virtual stages "
            "interleave over pipeline ranks)",
            "write one stage, or set pp > 1",
        )
    args.startup_notes.append(
        f"--pipeline-model-parallel-layout {text}: " + "; ".join(layout.table().splitlines())
    )
    return layout.vpp
