"""`validate_args`: every check that needs no process group, and the derived values.

Runs on every rank before any collective, so a bad run fails everywhere alike with one line
naming the flag, the rule and a fix. Fills in: data_parallel_size, global_batch_size,
num_microbatches, virtual_pipeline_model_parallel_size, num_query_groups, ffn_hidden_size,
max_position_embeddings, lr_decay_iters, lr_warmup_iters, start/end weight decay,
compile_backend.
"""

from __future__ import annotations

import argparse
import math
import os


class ArgumentError(ValueError):
    """A flag (or flag combination) that cannot work; the message is one line."""


def _fail(flag: str, value: object, rule: str, fix: str) -> None:
    raise ArgumentError(f"--{flag}={value}: {rule}; fix: {fix}")


def _check_positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            _fail(name.replace("_", "-"), value, "must be >= 1", "pass a positive integer")


# Flags without a default in Megatron-LM either: its validate_args requires the first four,
# and the rest have no value a run could assume.
_REQUIRED = (
    ("num_layers", "--num-layers 24"),
    ("hidden_size", "--hidden-size 1024"),
    ("num_attention_heads", "--num-attention-heads 16"),
    ("seq_length", "--seq-length 2048"),
    ("max_position_embeddings", "--max-position-embeddings 2048 (>= --seq-length)"),
    ("micro_batch_size", "--micro-batch-size 1"),
    ("lr", "--lr 3e-4"),
)


def _required(args: argparse.Namespace) -> None:
    for name, example in _REQUIRED:
        if getattr(args, name) is None:
            flag = name.replace("_", "-")
            _fail(
                flag, None, "required (Megatron-LM has no default either)", f"pass e.g. {example}"
            )


def _megatron_forms(args: argparse.Namespace) -> None:
    """Megatron's spellings onto ours: --cp-comm-type's per-layer list, --recompute-activations,
    --no-position-embedding, --attention-backend's device rule, and refusals of what the
    model cannot do."""
    kinds = set(args.cp_comm_type) if isinstance(args.cp_comm_type, list) else {args.cp_comm_type}
    kinds = {"all_gather" if k == "allgather" else k for k in kinds}
    if len(kinds) != 1:
        _fail(
            "cp-comm-type",
            " ".join(args.cp_comm_type),
            "one type for every layer, p2p, allgather, a2a or a2a+p2p (a per-layer mix is "
            "not built)",
            "pass one of them",
        )
    args.cp_comm_type = kinds.pop()
    if args.recompute_activations:
        if args.recompute_granularity not in (None, "selective"):
            _fail(
                "recompute-activations",
                True,
                f"means --recompute-granularity selective, not {args.recompute_granularity}",
                "pass one of them",
            )
        args.recompute_granularity = "selective"
    if not args.add_position_embedding and args.position_embedding_type not in ("rope", "yarn"):
        _fail(
            "no-position-embedding",
            True,
            "deprecated in Megatron-LM (it refuses it too unless the positions are RoPE)",
            "use --position-embedding-type none",
        )
    if args.reset_attention_mask:
        _fail(
            "reset-attention-mask",
            True,
            "attention is causal over the whole sequence (SDPA is_causal); per-document "
            "masks are not built",
            "drop --reset-attention-mask (--reset-position-ids and --eod-mask-loss work)",
        )
    if args.moe_token_dispatcher_type == "flex":
        _fail(
            "moe-token-dispatcher-type",
            f"flex (--moe-flex-dispatcher-backend {args.moe_flex_dispatcher_backend})",
            "needs the DeepEP / HybridEP GPU kernels, which are not wired",
            "use --moe-token-dispatcher-type alltoall",
        )
    if args.moe_router_pre_softmax and args.moe_router_score_function == "sigmoid":
        # DeepSeek-V3's Megatron script passes both; Megatron's router reads the flag only
        # in its softmax branch
        args.moe_router_pre_softmax = False
        args.startup_notes.append(
            "--moe-router-pre-softmax: no effect with --moe-router-score-function sigmoid "
            "(Megatron-LM ignores it there too: sigmoid scores are normalised over the top-k)"
        )
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        _fail("decoupled-min-lr", args.decoupled_min_lr, "needs --decoupled-lr", "add it")
    if args.grad_reduce_in_bf16 and not args.bf16:
        _fail("grad-reduce-in-bf16", True, "reduces bf16 grads: needs --bf16", "add --bf16")


def _parallel_layout(args: argparse.Namespace, world_size: int) -> None:
    tp, pp, cp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
    )
    if world_size % (tp * pp * cp):
        _fail(
            "tensor-model-parallel-size",
            tp,
            f"world size {world_size} must be divisible by tp*pp*cp = {tp}*{pp}*{cp}",
            "change the sizes or the number of processes (torchrun --nproc-per-node)",
        )
    args.data_parallel_size = world_size // (tp * pp * cp)
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size or tp
    if world_size % (etp * ep * pp):
        _fail(
            "expert-model-parallel-size",
            ep,
            f"world size {world_size} must be divisible by etp*ep*pp = {etp}*{ep}*{pp} "
            "(the expert grid)",
            "change --expert-model-parallel-size / --expert-tensor-parallel-size",
        )
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # Megatron's rule: SP is a no-op without tp
    if args.sequence_parallel and args.seq_length % tp:
        _fail(
            "seq-length",
            args.seq_length,
            f"with --sequence-parallel it must be divisible by tp={tp}",
            "pick a multiple of the tensor-parallel size",
        )


def _context_parallel(args: argparse.Namespace) -> None:
    """cp rules: the sequence splits into 2*cp chunks (and each over tp with SP); a2a
    shards heads and groups over tp*cp; no attention dropout or custom masks."""
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    a2a = _hierarchical_cp(args, cp)
    if cp == 1:
        return
    split = 2 * cp * (tp if args.sequence_parallel else 1)
    if args.seq_length % split:
        what = f"2*cp*tp = 2*{cp}*{tp}" if args.sequence_parallel else f"2*cp = 2*{cp}"
        _fail(
            "seq-length",
            args.seq_length,
            f"with --context-parallel-size {cp} it must be divisible by {what} = {split} "
            "(load-balanced causal chunks)",
            f"pick a multiple of {split}",
        )
    if a2a > 1:
        over = f"tp*cp = {tp * cp}" if args.cp_comm_type == "a2a" else f"tp*{a2a} = {tp * a2a}"
        for flag, value in (
            ("num-attention-heads", args.num_attention_heads),
            ("num-query-groups", args.num_query_groups),
        ):
            if value % (tp * a2a):
                _fail(
                    flag,
                    value,
                    f"--cp-comm-type {args.cp_comm_type} shards heads and groups over {over}",
                    "use --cp-comm-type p2p or all_gather, or a cp (with a2a+p2p: a first "
                    "hierarchical size) that divides them",
                )
    if args.attention_dropout > 0:
        _fail(
            "attention-dropout",
            args.attention_dropout,
            "context-parallel attention has no attention dropout",
            "pass --attention-dropout 0",
        )


def _hierarchical_cp(args: argparse.Namespace, cp: int) -> int:
    """Megatron's rules: the sizes multiply to cp; a2a+p2p needs them (two levels here, as
    in Transformer Engine). -> the ranks one all-to-all spans (cp for a2a, 1 for the
    kinds without one)."""
    sizes = args.hierarchical_context_parallel_sizes
    if sizes is not None and (any(x < 1 for x in sizes) or math.prod(sizes) != cp):
        _fail(
            "hierarchical-context-parallel-sizes",
            " ".join(map(str, sizes)),
            f"the sizes are positive and multiply to --context-parallel-size {cp}",
            f"pass sizes whose product is {cp}, e.g. 2 {max(cp // 2, 1)}",
        )
    if args.cp_comm_type != "a2a+p2p":
        return cp if args.cp_comm_type == "a2a" else 1
    if sizes is None or len(sizes) != 2:
        _fail(
            "cp-comm-type",
            "a2a+p2p",
            "needs --hierarchical-context-parallel-sizes with two sizes: the all-to-all's "
            "and the ring's",
            f"add --hierarchical-context-parallel-sizes 2 {max(cp // 2, 1)} (their product "
            f"is --context-parallel-size {cp})",
        )
    return sizes[0]


def _pipeline_schedule(args: argparse.Namespace) -> None:
    """--pipeline-schedule against the layout: the default is Megatron's pick."""
    schedule, pp = args.pipeline_schedule, args.pipeline_model_parallel_size
    vpp = args.virtual_pipeline_model_parallel_size
    if schedule is None:
        return
    if pp == 1:
        _fail("pipeline-schedule", schedule, "a schedule needs pp > 1", "drop the flag")
    if schedule == "zbv":
        _zbv(args)
    elif (schedule == "interleaved") != (vpp is not None):
        _fail(
            "pipeline-schedule",
            schedule,
            f"with --virtual-pipeline-model-parallel-size {vpp}: only the interleaved "
            "schedule runs virtual stages",
            "set virtual stages for interleaved, or drop them",
        )
    if schedule not in ("zb-h1", "zbv"):
        return
    refused = [
        ("use-torch-fsdp2", args.use_torch_fsdp2, "FSDP2 reduces grads in backward hooks"),
        ("enable-cuda-graph", args.enable_cuda_graph, "a graph replays B and W as one"),
        (
            "compile",
            args.compile,
            "a compiled layer's backward is traced once, with or without the deferral",
        ),
        (
            "transformer-impl",
            args.transformer_impl == "transformer_engine",
            "transformer-engine's linears compute their weight gradients in their own backward",
        ),
    ]
    for flag, value, why in refused:
        if value:
            _fail(
                flag,
                args.transformer_impl if flag == "transformer-impl" else value,
                f"with --pipeline-schedule {schedule}: {why}, which the schedule cannot defer",
                f"drop {flag} or use --pipeline-schedule 1f1b",
            )


def _zbv(args: argparse.Namespace) -> None:
    """ZBV places two chunks per rank in a V (rank 0: the first and the last stage): the
    model is built as two virtual stages (vpp 2, V placement), evenly split."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    refused = [
        (
            "pipeline-model-parallel-layout",
            args.pipeline_model_parallel_layout,
            "the V places its 2p stages itself, evenly",
            "drop the flag",
        ),
        (
            "num-virtual-stages-per-pipeline-rank",
            args.num_virtual_stages_per_pipeline_rank,
            "ZBV's two chunks per rank are its V, not interleaved virtual stages",
            "drop the flag",
        ),
        (
            "account-for-embedding-in-pipeline-split",
            args.account_for_embedding_in_pipeline_split or None,
            "the V splits the layers evenly over its 2p stages",
            "drop the flag",
        ),
        (
            "account-for-loss-in-pipeline-split",
            args.account_for_loss_in_pipeline_split or None,
            "the V splits the layers evenly over its 2p stages",
            "drop the flag",
        ),
        (
            "virtual-pipeline-model-parallel-size",
            args.virtual_pipeline_model_parallel_size,
            "ZBV's two chunks per rank are its V, not interleaved virtual stages",
            "drop the flag",
        ),
        (
            "decoder-first-pipeline-num-layers",
            args.decoder_first_pipeline_num_layers,
            "the V splits the layers evenly over its 2p stages",
            "drop the flag",
        ),
        (
            "decoder-last-pipeline-num-layers",
            args.decoder_last_pipeline_num_layers,
            "the V splits the layers evenly over its 2p stages",
            "drop the flag",
        ),
        (
            "untie-embeddings-and-output-weights",
            not args.untie_embeddings_and_output_weights,
            "tied embeddings would sit in both chunks of rank 0",
            "pass --untie-embeddings-and-output-weights",
        ),
        (
            "mtp-num-layers",
            args.mtp_num_layers,
            "multi-token prediction shares the embedding across stages",
            "drop the flag or use --pipeline-schedule 1f1b",
        ),
    ]
    for flag, value, why, fix in refused:
        if value:
            shown = "unset" if flag == "untie-embeddings-and-output-weights" else value
            _fail(flag, shown, f"with --pipeline-schedule zbv: {why}", fix)
    if layers % (2 * pp):
        _fail(
            "num-layers",
            layers,
            f"with --pipeline-schedule zbv: the V has 2 x pp = {2 * pp} stages of equal size",
            f"use a multiple of {2 * pp} layers",
        )
    args.virtual_pipeline_model_parallel_size = 2  # the model's two chunks per rank


# Megatron's defaults of the MLA shape flags: set to anything else they need MLA.
_MLA_SHAPE = {
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "v_head_dim": 128,
}


def _rope_type(args: argparse.Namespace) -> None:
    """--rope-type: MLA takes YaRN unless `rope` (then no scaling); standard attention takes
    YaRN with --position-embedding-type yarn (Megatron's), which reads the same flags."""
    yarn_set = [
        f"--{d.replace('_', '-')}"
        for d, default in (("rotary_scaling_factor", 1.0), ("mscale", 1.0), ("mscale_all_dim", 0.0))
        if getattr(args, d) != default
    ]
    if not args.multi_latent_attention:
        if args.rope_type == "yarn":
            _fail(
                "rope-type",
                "yarn",
                "--rope-type picks multi-latent attention's RoPE",
                "use --position-embedding-type yarn for standard attention",
            )
        if yarn_set and args.position_embedding_type != "yarn":
            flag = yarn_set[0][2:]
            _fail(
                flag,
                getattr(args, flag.replace("-", "_")),
                "a YaRN setting, read with --position-embedding-type yarn (or MLA's RoPE)",
                "add --position-embedding-type yarn, or drop it",
            )
    elif args.rope_type == "rope" and yarn_set:
        _fail(
            yarn_set[0][2:],
            getattr(args, yarn_set[0][2:].replace("-", "_")),
            "a YaRN setting, with --rope-type rope (plain RoPE)",
            "drop --rope-type rope (MLA takes YaRN by default)",
        )


def _model_shape(args: argparse.Namespace) -> None:
    _rope_type(args)
    if args.quick_geglu and args.swiglu:
        _fail("quick-geglu", True, "--quick-geglu and --swiglu are exclusive", "pass one")
    if not args.multi_latent_attention:
        for dest, default in _MLA_SHAPE.items():
            if getattr(args, dest) != default:
                _fail(
                    dest.replace("_", "-"),
                    getattr(args, dest),
                    "a multi-latent attention shape: read only with --multi-latent-attention",
                    "add --multi-latent-attention, or drop it",
                )
    tp = args.tensor_model_parallel_size
    heads = args.num_attention_heads
    if args.hidden_size % heads and args.kv_channels is None:
        _fail(
            "num-attention-heads",
            heads,
            f"must divide --hidden-size {args.hidden_size}",
            "pick a divisor, or set --kv-channels",
        )
    if heads % tp:
        _fail(
            "num-attention-heads",
            heads,
            f"must be divisible by --tensor-model-parallel-size {tp}",
            "use a head count that tp divides",
        )
    if not args.group_query_attention:
        args.num_query_groups = heads
    groups = args.num_query_groups or heads
    if heads % groups or groups % tp:
        _fail(
            "num-query-groups",
            groups,
            f"must divide the {heads} heads and be divisible by tp={tp}",
            "adjust the groups",
        )
    args.num_query_groups = groups
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = (
            # Megatron's rule: 2/3 of 4h rounded down to a multiple of 64
            int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size
        )
    if args.ffn_hidden_size % tp:
        _fail(
            "ffn-hidden-size",
            args.ffn_hidden_size,
            f"must be divisible by tp={tp}",
            "round it to a multiple of the tensor-parallel size",
        )
    if args.seq_length > args.max_position_embeddings:
        _fail(
            "seq-length",
            args.seq_length,
            f"exceeds --max-position-embeddings {args.max_position_embeddings}",
            "raise --max-position-embeddings",
        )


def _batch(args: argparse.Namespace) -> None:
    mbs, dp = args.micro_batch_size, args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    gbs = args.global_batch_size
    if gbs % (mbs * dp):
        _fail(
            "global-batch-size",
            gbs,
            f"must be divisible by micro-batch-size*dp = {mbs}*{dp} = {mbs * dp}",
            f"use a multiple of {mbs * dp}",
        )
    if args.rampup_batch_size is not None:
        start, incr, _ = args.rampup_batch_size
        if start % (mbs * dp) or incr % (mbs * dp):
            _fail(
                "rampup-batch-size",
                args.rampup_batch_size,
                f"start and increment must be multiples of mbs*dp = {mbs * dp}",
                "adjust them",
            )
    args.num_microbatches = gbs // (mbs * dp)
    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    if vpp and args.num_microbatches % pp:
        _fail(
            "global-batch-size",
            gbs,
            f"interleaving needs the {args.num_microbatches} micro-batches per step to be a "
            f"multiple of pp={pp}",
            f"use a global batch that is a multiple of {mbs * dp * pp}",
        )


def _iterations_for_samples(args: argparse.Namespace) -> int:
    """Megatron's update_train_iters: the ramp-up's iterations (each at its global batch),
    then the constant batch; a last partial batch is dropped."""
    from .training.microbatches import global_batch_size

    iterations = consumed = 0
    if args.rampup_batch_size is not None:
        while consumed <= int(args.rampup_batch_size[2]) and consumed <= args.train_samples:
            consumed += global_batch_size(args, consumed)
            iterations += 1
    if args.train_samples > consumed:
        iterations += (args.train_samples - consumed) // args.global_batch_size
    return iterations


def _schedule_in_samples(args: argparse.Namespace) -> None:
    """--train-samples: the lr / wd schedule counts samples (Megatron's rule), so warm-up and
    decay are --lr-warmup-samples / --lr-decay-samples and iteration counts are refused."""
    for flag, value in (
        ("lr-decay-iters", args.lr_decay_iters),
        ("lr-wsd-decay-iters", args.lr_wsd_decay_iters),
    ):
        if value is not None:
            _fail(
                flag,
                value,
                "with --train-samples the schedule counts samples",
                f"use --{flag.replace('iters', 'samples')}",
            )
    if args.lr_warmup_iters:
        _fail(
            "lr-warmup-iters",
            args.lr_warmup_iters,
            "with --train-samples the schedule counts samples",
            "use --lr-warmup-samples",
        )
    args.train_iters = _iterations_for_samples(args)
    if args.lr_decay_samples is None:
        args.lr_decay_samples = args.train_samples
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_samples = int(args.lr_warmup_fraction * args.lr_decay_samples)
    if args.lr_warmup_samples and args.lr_warmup_samples >= args.lr_decay_samples:
        _fail(
            "lr-warmup-samples",
            args.lr_warmup_samples,
            f"must be below --lr-decay-samples {args.lr_decay_samples}",
            "shorten the warm-up",
        )


def _training_length(args: argparse.Namespace) -> None:
    if (args.train_iters is None) == (args.train_samples is None):
        _fail(
            "train-iters",
            args.train_iters,
            "exactly one of --train-iters / --train-samples",
            "pass one of them",
        )
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay
    if args.train_samples is not None:
        _schedule_in_samples(args)
        return
    for flag, value in (
        ("lr-decay-samples", args.lr_decay_samples),
        ("lr-wsd-decay-samples", args.lr_wsd_decay_samples),
        ("lr-warmup-samples", args.lr_warmup_samples or None),
    ):
        if value is not None:
            _fail(
                flag,
                value,
                "with --train-iters the schedule counts iterations",
                f"use --{flag.replace('samples', 'iters')}",
            )
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    if args.lr_warmup_iters and args.lr_warmup_iters >= args.lr_decay_iters:
        _fail(
            "lr-warmup-iters",
            args.lr_warmup_iters,
            f"must be below --lr-decay-iters {args.lr_decay_iters}",
            "shorten the warm-up",
        )


def _attention_variants_spec(args: argparse.Namespace) -> None:
    """gpt-oss's sinks and sliding windows run in the local attention (pentatron.models
    attention_variants); the transformer-engine layout's attention is plain causal."""
    variants = [
        f"--{flag} {value}"
        for flag, value, default in (
            ("softmax-type", args.softmax_type, "vanilla"),
            ("window-size", args.window_size, None),
        )
        if value != default
    ]
    if not variants or args.transformer_impl != "transformer_engine":
        return
    if args.fp8_format:
        _fail(
            "fp8-format",
            args.fp8_format,
            f"FP8 runs through the transformer-engine layout, whose attention has no "
            f"{' / '.join(variants)}",
            "drop --fp8-format, or the attention variant",
        )
    args.transformer_impl = "local"
    args.startup_notes.append(
        f"{', '.join(variants)}: runs on the local PyTorch spec (the transformer-engine "
        "attention is wired for the plain softmax only); pass --transformer-impl local to "
        "silence this"
    )


def _context_parallel_spec(args: argparse.Namespace) -> None:
    """Context parallelism runs in the local attention (pentatron.models.context_parallel:
    flash kernels per block, over the cp group); the transformer-engine layout's attention
    is not wired to the cp group (GPTModel would refuse it after the groups exist)."""
    cp = args.context_parallel_size
    if cp == 1 or args.transformer_impl != "transformer_engine":
        return
    if args.fp8_format:
        _fail(
            "fp8-format",
            args.fp8_format,
            f"FP8 runs through the transformer-engine layout, whose attention is not wired "
            f"to the context-parallel group (--context-parallel-size {cp})",
            "drop --fp8-format, or use --context-parallel-size 1",
        )
    args.transformer_impl = "local"
    args.startup_notes.append(
        f"--context-parallel-size {cp} runs on the local PyTorch spec (its attention runs "
        "over the cp group; the transformer-engine layout's is not wired to it yet); pass "
        "--transformer-impl local to silence this"
    )


def _precision_and_gpu(args: argparse.Namespace, cuda: bool, have_te: bool) -> None:
    if args.fp16 and args.bf16:
        _fail("fp16", True, "--fp16 and --bf16 are exclusive", "pass one")
    if args.fp16 and args.loss_scale is None and args.check_for_nan_in_loss_and_grad:
        # As Megatron: under dynamic loss scaling an Inf/NaN grad is an overflow the
        # optimizer answers by skipping the step and backing off the scale, not an error.
        args.check_for_nan_in_loss_and_grad = False
        args.startup_notes.append(
            "--fp16 with dynamic loss scaling: the grads' NaN/Inf check is off (an overflow "
            "skips the step and halves the loss scale, as in Megatron); the loss is still checked"
        )
    if args.transformer_impl == "transformer_engine" and not (cuda and have_te):
        why = "no CUDA device" if not cuda else "transformer-engine is not installed"
        if args.fp8_format:
            _fail(
                "fp8-format",
                args.fp8_format,
                f"needs CUDA and transformer-engine ({why})",
                "drop it, or install transformer-engine on a CUDA machine",
            )
        args.transformer_impl = "local"
        args.startup_notes.append(
            f"--transformer-impl transformer_engine (Megatron's default): {why}, so the "
            "local PyTorch spec runs (same numerics); pass --transformer-impl local to "
            "silence this"
        )
    if args.multi_latent_attention and args.transformer_impl == "transformer_engine":
        if args.fp8_format:
            _fail(
                "fp8-format",
                args.fp8_format,
                "FP8 runs through the transformer-engine layout, which multi-latent attention "
                "does not have yet",
                "drop --fp8-format for MLA models",
            )
        args.transformer_impl = "local"
        args.startup_notes.append(
            "--multi-latent-attention runs on the local PyTorch spec (its transformer-engine "
            "layout is not built yet); pass --transformer-impl local to silence this"
        )
    _context_parallel_spec(args)
    _attention_variants_spec(args)
    needs_gpu = {
        "enable-cuda-graph": args.enable_cuda_graph,
        "fp8-format": args.fp8_format,
        # torch has a CPU FlashAttention kernel; cuDNN / memory-efficient ones are CUDA's
        "attention-backend": args.attention_backend if args.attention_backend == "fused" else None,
    }
    for flag, value in needs_gpu.items():
        if value and not cuda:
            _fail(
                flag,
                value,
                "needs CUDA (and transformer-engine for fp8)",
                "drop the flag on CPU",
            )
    if args.enable_cuda_graph:
        _cuda_graph(args)
    if args.fp8_format and args.transformer_impl != "transformer_engine":
        _fail(
            "fp8-format",
            args.fp8_format,
            "FP8 runs through the transformer-engine spec",
            "install transformer-engine and pass --transformer-impl transformer_engine",
        )
    if args.device == "cuda" and not cuda:
        _fail("device", "cuda", "torch sees no CUDA device here", "use --device cpu or auto")


def _cuda_graph(args: argparse.Namespace) -> None:
    """The app-level limits of --enable-cuda-graph (the model's are TransformerConfig's)."""
    refused = [
        (
            "use-torch-fsdp2",
            args.use_torch_fsdp2,
            "FSDP2 gathers and frees params around each layer from Python hooks a replay skips",
        ),
        ("fp8-format", args.fp8_format, "FP8 scaling factors are updated outside the graph"),
        (
            "rampup-batch-size",
            args.rampup_batch_size,
            "the graphs hold one step's micro-batch count",
        ),
    ]
    for flag, value, why in refused:
        if value:
            _fail(flag, value, f"with --enable-cuda-graph: {why}", f"drop {flag} or the graphs")


def _fsdp2(args: argparse.Namespace) -> None:
    """FSDP2 replaces DDP and the distributed optimizer over dp x cp (see training/setup)."""
    if not args.use_torch_fsdp2:
        return
    fix = "drop --use-torch-fsdp2 or the other flag"
    if args.use_distributed_optimizer:
        _fail(
            "use-distributed-optimizer",
            True,
            "FSDP2 already shards the optimizer state (and params, grads) over dp",
            fix,
        )
    if args.fp16:
        _fail("fp16", True, "FSDP2 runs bf16 or fp32 (no fp16 loss scaling)", "use --bf16")
    etp = args.expert_tensor_parallel_size
    if args.num_experts and etp is not None and etp != args.tensor_model_parallel_size:
        _fail(
            "expert-tensor-parallel-size",
            etp,
            "with FSDP2 the experts are sharded over the dense dp x cp mesh, so etp must be tp",
            "leave --expert-tensor-parallel-size unset",
        )


def _compile(args: argparse.Namespace) -> None:
    """--compile's limits, each measured (docs/architecture.md, "torch.compile")."""
    if not args.compile:
        if args.compile_backend is not None:
            _fail(
                "compile-backend",
                args.compile_backend,
                "has no effect without --compile",
                "add --compile or drop --compile-backend",
            )
        return
    args.compile_backend = args.compile_backend or "inductor"
    cp_ring = args.context_parallel_size > 1 and args.cp_comm_type in ("p2p", "a2a+p2p")
    refused = [
        (
            "enable-cuda-graph",
            args.enable_cuda_graph,
            "capturing compiled layers in our CUDA graphs is not verified on a GPU",
            "drop one of them",
        ),
        (
            "transformer-impl",
            args.transformer_impl if args.transformer_impl == "transformer_engine" else None,
            "Dynamo does not trace transformer-engine's modules (a graph break at each, "
            "and its FP8 delayed scaling is unsupported under torch.compile)",
            "use --transformer-impl local, or drop --compile",
        ),
        (
            "num-experts",
            args.num_experts,
            "a MoE layer routes a data-dependent number of tokens (about 15 graph breaks "
            "a layer, and recompiles as the routing changes)",
            "drop --compile for MoE models",
        ),
        (
            "cp-comm-type",
            args.cp_comm_type if cp_ring else None,
            "the ring's send/recv of k/v chunks is not traceable (graph breaks at every step)",
            "use --cp-comm-type all_gather or a2a",
        ),
    ]
    for flag, value, why, fix in refused:
        if value:
            _fail(flag, value, f"with --compile: {why}", fix)


def _data_and_checkpoints(args: argparse.Namespace) -> None:
    args.split = "969,30,1" if args.split is None else args.split  # Megatron's, with data
    args.dataloader_type = args.dataloader_type or "single"
    if args.tokenizer_type is None and args.vocab_file and args.merge_file:
        # Megatron's GPT-3 example passes only the two GPT-2 BPE files
        args.tokenizer_type = "GPT2BPETokenizer"
        args.startup_notes.append(
            "--tokenizer-type not given: --vocab-file / --merge-file are read as GPT2BPETokenizer"
        )
    if args.data_path:
        from .data.builder import parse_data_path

        for prefix in parse_data_path(args.data_path)[0]:
            if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
                _fail(
                    "data-path",
                    prefix,
                    "no .bin/.idx pair with this prefix",
                    "pass the prefix written by pentatron-preprocess-data (no extension)",
                )
        if args.tokenizer_type is None:
            _fail(
                "tokenizer-type",
                None,
                "required with --data-path",
                "e.g. --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR",
            )
    if args.save_interval is not None and args.save is None:
        _fail("save-interval", args.save_interval, "needs --save", "pass --save DIR")
    if args.async_save and args.save is None:
        _fail("async-save", True, "needs --save", "pass --save DIR")
    if args.ckpt_format != "torch_dist":
        _fail(
            "ckpt-format",
            args.ckpt_format,
            "this release reads and writes only torch_dist (sharded, loadable at any layout)",
            "pass --ckpt-format torch_dist or drop the flag",
        )


# TransformerConfig fields whose flag is not the field name with dashes.
_FIELD_FLAGS = {
    "num_moe_experts": "num-experts",
    "layernorm_epsilon": "norm-epsilon",
    "activation": "swiglu",
    "window_attn_skip_freq": "window-attn-skip-freq",
    "rope_scaling": "use-rope-scaling",
    "add_bias_linear": "disable-bias-linear",
    "fp8": "fp8-format",
    "tensor_model_parallel_size": "tensor-model-parallel-size",
    "num_layers_in_first_pipeline_stage": "decoder-first-pipeline-num-layers",
    "num_layers_in_last_pipeline_stage": "decoder-last-pipeline-num-layers",
}


def _model_config(args: argparse.Namespace) -> None:
    """Build the TransformerConfig once: its rules (MoE, attention, pipeline split) fail here
    as one line naming the flag, before any process group."""
    from pentatron.models import ModelConfigError

    from .training.configs import transformer_config

    try:
        transformer_config(args)
    except ModelConfigError as e:
        field = str(e).split("=", 1)[0].split(" ", 1)[0].split(".", 1)[0]
        flag = _FIELD_FLAGS.get(field, field.replace("_", "-"))
        raise ArgumentError(f"--{flag}{str(e)[len(field) :]}") from None


def validate_args(
    args: argparse.Namespace, world_size: int, cuda: bool = False, have_te: bool | None = None
):
    """Check `args` for `world_size` processes; fill the derived values; return `args`.

    `cuda` / `have_te`: whether the run has a CUDA device and transformer-engine (default:
    whether this process can import it; the memory calculator sizes a GPU run elsewhere).

    `args.startup_notes`: lines the app prints once at start-up (Megatron flags that select
    what runs anyway, and defaults that cannot hold here)."""
    from .arguments_compat import resolve_compat
    from .arguments_logging import validate_logging_args
    from .hf.config import resolve_pretrained

    args.startup_notes = []
    resolve_pretrained(args)  # --use-checkpoint-args fills model flags before they are checked
    _required(args)
    _megatron_forms(args)
    args.startup_notes += resolve_compat(args)
    validate_logging_args(args, world_size, cuda)
    _check_positive(
        args,
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "micro_batch_size",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "log_interval",
        "eval_interval",
        "train_iters",
        "global_batch_size",
        "save_interval",
    )
    _parallel_layout(args, world_size)
    from .arguments_pipeline import virtual_stages  # (it imports this module's _fail)

    virtual_stages(args)
    _model_shape(args)
    _context_parallel(args)
    _batch(args)
    _training_length(args)
    if have_te is None:
        from pentatron.models import HAVE_TE

        have_te = HAVE_TE
    _precision_and_gpu(args, cuda, have_te)
    _pipeline_schedule(args)
    _fsdp2(args)
    _compile(args)
    _data_and_checkpoints(args)
    _model_config(args)
    _hugging_face(args)
    return args


def _hugging_face(args: argparse.Namespace) -> None:
    """--pretrained-checkpoint (a Hugging Face one) agrees with the model flags;
    --export-hf-dir is a new directory and the model has a Hugging Face form."""
    from .hf.config import check_against_hf
    from .hf.export import check_exportable
    from .hf.load import check_complete
    from .training.configs import transformer_config

    check_against_hf(args)
    if args.pretrained_kind == "hf":
        check_complete(args.pretrained_checkpoint, transformer_config(args))
    if args.export_hf_dir:
        check_exportable(args)
