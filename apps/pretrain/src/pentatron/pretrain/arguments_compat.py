"""Megatron-LM flags that pick a kernel, a fusion or a feature we lack: accepted so that a
Megatron-LM launch script runs unchanged, each with one of three fates.

- NOTED: Megatron's choice between kernels of the same maths, where this release has one
  implementation. The flag is read and, when set, named once at start-up with what runs.
- REFUSED: a feature that needs hardware or packages we do not have, or that this release
  does not build. Validation stops with one line: the flag, why, and the fix.
- MAPPED: turned into our own flags in `resolve_compat` (Megatron-FSDP onto FSDP2 or the
  distributed optimizer, --recompute-activations onto selective recompute, ...).

Flags that change the model or the schedule (rotary percent, decoupled lr, sample-based
schedules, ...) live with their group in `arguments.py`; these are the rest.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from .arguments_validate import ArgumentError


def add_compat_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Megatron-LM kernel and feature choices")
    # kernel choices (NOTED)
    g.add_argument("--use-mcore-models", dest="deprecated_use_mcore_models", action="store_true")
    g.add_argument("--use-flash-attn", action="store_true")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false")
    g.add_argument("--no-bias-dropout-fusion", dest="bias_dropout_fusion", action="store_false")
    g.add_argument("--no-rope-fusion", dest="apply_rope_fusion", action="store_false")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true")
    g.add_argument("--cross-entropy-fusion-impl", default="native", choices=["native", "te"])
    g.add_argument("--moe-permute-fusion", action="store_true")
    g.add_argument(
        "--no-create-attention-mask-in-dataloader",
        dest="create_attention_mask_in_dataloader",
        action="store_false",
    )
    g.add_argument("--enable-experimental", action="store_true")
    # features we lack (REFUSED when set)
    g.add_argument("--use-nccl-ub", action="store_true")
    g.add_argument("--fsdp-double-buffer", action="store_true")
    g.add_argument("--fsdp-manual-registration", action="store_true")
    g.add_argument("--init-model-with-meta-device", action="store_true")
    g.add_argument("--fp8-param-gather", action="store_true")
    g.add_argument(
        "--moe-flex-dispatcher-backend", default="deepep", choices=["deepep", "hybridep"]
    )
    # Megatron-FSDP (MAPPED onto FSDP2 / the distributed optimizer)
    g.add_argument("--use-megatron-fsdp", action="store_true")
    g.add_argument(
        "--data-parallel-sharding-strategy",
        default="optim_grads_params",
        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
    )
    g.add_argument(
        "--megatron-fsdp-grad-comm-dtype", default="auto", choices=["fp32", "fp16", "bf16", "auto"]
    )
    g.add_argument(
        "--megatron-fsdp-main-grads-dtype", default="auto", choices=["fp32", "bf16", "fp16", "auto"]
    )


# dest -> (is it set?, what runs instead). Set means "not Megatron's default".
_NOTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "deprecated_use_mcore_models": (
        bool,
        "Megatron ignores it too: core models are the only ones",
    ),
    "use_flash_attn": (
        bool,
        "attention runs through torch SDPA, which takes FlashAttention on GPUs where it "
        "applies; --attention-backend flash insists on it",
    ),
    "masked_softmax_fusion": (
        lambda v: not v,
        "the causal softmax runs inside SDPA; there is no separate masked-softmax kernel",
    ),
    "bias_gelu_fusion": (
        lambda v: not v,
        "GeLU and its bias run as separate PyTorch ops here (the unfused path)",
    ),
    "bias_dropout_fusion": (
        lambda v: not v,
        "bias, dropout and residual add are separate PyTorch ops here (the unfused path)",
    ),
    "apply_rope_fusion": (
        lambda v: not v,
        "RoPE is plain PyTorch ops here (the unfused path)",
    ),
    "attention_softmax_in_fp32": (
        bool,
        "SDPA accumulates the softmax in fp32 for bf16/fp16 inputs",
    ),
    "cross_entropy_loss_fusion": (
        bool,
        "the vocab-parallel cross entropy is one autograd function (Megatron's native "
        "fusion: same numerics)",
    ),
    "moe_permute_fusion": (
        bool,
        "tokens are permuted with PyTorch index ops (same numerics as TE's fused permute)",
    ),
    "create_attention_mask_in_dataloader": (
        lambda v: not v,
        "the loader never builds a mask: attention is causal by construction (SDPA is_causal)",
    ),
    "enable_experimental": (bool, "no feature of this release is gated by it"),
}

_LATER = "not in this release"
# dest -> (is it set?, why, fix)
_REFUSED: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "use_nccl_ub": (
        bool,
        "NCCL user-buffer registration: our FSDP2 and DDP paths do not register buffers",
        "drop --use-nccl-ub",
    ),
    "fsdp_double_buffer": (
        bool,
        "Megatron-FSDP's double-buffered all-gather; FSDP2 manages its own buffers",
        "drop --fsdp-double-buffer",
    ),
    "fsdp_manual_registration": (
        bool,
        "Megatron-FSDP's manual NCCL buffer registration; FSDP2 manages its own buffers",
        "drop --fsdp-manual-registration",
    ),
    "init_model_with_meta_device": (
        bool,
        "weights are initialised in full, then sharded, so every layout starts from the "
        "same numbers",
        "drop --init-model-with-meta-device",
    ),
    "fp8_param_gather": (
        bool,
        "FP8 parameter all-gather (fp8 primary weights) is " + _LATER,
        "drop --fp8-param-gather (FP8 compute still runs with --fp8-format)",
    ),
    "cross_entropy_fusion_impl": (
        lambda v: v != "native",
        "transformer-engine's cross-entropy kernel is not wired",
        "use --cross-entropy-fusion-impl native",
    ),
}

_FLAG_OF = {
    "deprecated_use_mcore_models": "--use-mcore-models",
    "masked_softmax_fusion": "--no-masked-softmax-fusion",
    "bias_dropout_fusion": "--no-bias-dropout-fusion",
    "apply_rope_fusion": "--no-rope-fusion",
    "bias_gelu_fusion": "--no-bias-gelu-fusion",
    "create_attention_mask_in_dataloader": "--no-create-attention-mask-in-dataloader",
}


def _refuse(flag: str, value: object, why: str, fix: str) -> None:
    raise ArgumentError(f"{flag}={value}: {why}; fix: {fix}")


def _megatron_fsdp(args: argparse.Namespace) -> str | None:
    """--use-megatron-fsdp onto our data-parallel paths, by --data-parallel-sharding-strategy:
    optim_grads_params -> FSDP2 (params, grads and optimizer state sharded, params freed
    after forward); optim_grads -> FSDP2 keeping params gathered between forward and
    backward (ZeRO-2's memory, one all-gather a step); optim -> the distributed optimizer
    (ZeRO-1); no_shard -> DDP. Returns the start-up line, or None without the flag."""
    strategy = args.data_parallel_sharding_strategy
    if not args.use_megatron_fsdp:
        return None
    if args.use_torch_fsdp2:
        _refuse("--use-megatron-fsdp", True, "exclusive with --use-torch-fsdp2", "pass one")
    main = args.megatron_fsdp_main_grads_dtype
    if main not in ("auto", "fp32"):
        _refuse(
            "--megatron-fsdp-main-grads-dtype",
            main,
            "main grads are fp32 here (FSDP2 reduces into fp32 sharded grads)",
            "use auto or fp32",
        )
    comm = args.megatron_fsdp_grad_comm_dtype
    if strategy in ("optim_grads_params", "optim_grads"):
        args.use_torch_fsdp2 = True
        args.fsdp_reshard_after_forward = strategy == "optim_grads_params"
        if args.use_distributed_optimizer:
            args.use_distributed_optimizer = False  # FSDP2 shards the optimizer state itself
        args.fsdp_reduce_dtype = {"auto": None, "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}[
            comm
        ]
        how = "FSDP2" + (
            "" if args.fsdp_reshard_after_forward else " without reshard after forward"
        )
    else:
        if comm not in ("auto", "fp32"):
            _refuse(
                "--megatron-fsdp-grad-comm-dtype",
                comm,
                f"with --data-parallel-sharding-strategy {strategy} grads reduce in fp32",
                "use auto",
            )
        args.use_distributed_optimizer = strategy == "optim"
        how = "the distributed optimizer (ZeRO-1)" if strategy == "optim" else "DDP"
    return f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy}: runs as {how}"


def resolve_compat(args: argparse.Namespace) -> list[str]:
    """Refuse (ArgumentError) or map the flags above; return the start-up notes."""
    for dest, (is_set, why, fix) in _REFUSED.items():
        value = getattr(args, dest)
        if is_set(value):
            _refuse(_FLAG_OF.get(dest, "--" + dest.replace("_", "-")), value, why, fix)
    notes = []
    for dest, (is_set, what) in _NOTED.items():
        if is_set(getattr(args, dest)):
            notes.append(f"{_FLAG_OF.get(dest, '--' + dest.replace('_', '-'))}: {what}")
    args.fsdp_reshard_after_forward = True
    args.fsdp_reduce_dtype = None
    fsdp = _megatron_fsdp(args)
    if fsdp:
        notes.append(fsdp)
    return notes
