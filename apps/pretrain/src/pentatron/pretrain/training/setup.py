"""Start-up: process grid and seeds, model chunks, optimizer and scheduler, data iterators.

Megatron's `initialize_megatron`, `get_model`, `setup_model_and_optimizer` and
`build_train_valid_test_data_iterators`, each a function of the validated arguments.
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pentatron.optim import (
    DistributedDataParallel,
    FSDP2DataParallel,
    apply_fsdp2,
    get_optimizer,
)
from pentatron.parallel_state import ProcessGrid, initialize_model_parallel
from pentatron.tp_layers import model_parallel_seed

from . import configs
from .compile import compile_layers
from .init_weights import init_weights_layout_independent


def initialize(args: argparse.Namespace) -> ProcessGrid:
    """The process grid from torchrun's environment, then Megatron's seeding."""
    backend = {"cpu": "gloo", "cuda": "nccl"}.get(args.device)  # auto: CUDA when present
    grid = initialize_model_parallel(configs.parallel_config(args), backend=backend)
    set_matmul_precision(grid, args.disable_bf16_reduced_precision_matmul)
    seed = args.seed + 100 * grid.rank("pp")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_seed(seed, grid)
    return grid


def set_matmul_precision(grid: ProcessGrid, no_bf16_reduced_reduction: bool = False) -> None:
    """The TF32 policy, set explicitly: fp32 GEMMs stay full fp32 (TF32 off), cuDNN may use
    TF32. These are torch's defaults, which Megatron-LM keeps (it sets neither and has no
    flag; NVIDIA's containers export TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1, which makes cuBLAS
    use TF32 whatever is set here). bf16/fp16 training runs its GEMMs, weight gradients
    included, in bf16/fp16 on tensor cores, so the policy only touches fp32 models and
    the few fp32 GEMMs of a mixed-precision one. Said once at start-up on CUDA.

    `no_bf16_reduced_reduction` (--disable-bf16-reduced-precision-matmul): cuBLAS bf16 GEMMs
    may not reduce in reduced precision (torch's default allows it)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (
        not no_bf16_reduced_reduction
    )
    if grid.device.type == "cuda" and grid.global_rank == 0:
        override = os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1"
        print(
            "pentatron: fp32 matmuls "
            + (
                "use TF32 (TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1)"
                if override
                else "in full fp32 (TF32 off, torch's and Megatron-LM's default; "
                "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 enables it)"
            ),
            flush=True,
        )


def stage_flags(
    grid: ProcessGrid, vp_stage: int | None, vpp: int | None, placement: str = "loop"
) -> tuple[bool, bool]:
    """(pre_process, post_process) of chunk `vp_stage` on this pipeline rank; with the V
    placement (ZBV) rank 0's chunk 1 is the last stage."""
    pp_rank, pp = grid.rank("pp"), grid.size("pp")
    first = pp_rank == 0 and (vp_stage is None or vp_stage == 0)
    if placement == "v":
        return first, pp_rank == 0 and vp_stage == 1
    last = pp_rank == pp - 1 and (vp_stage is None or vp_stage == (vpp or 1) - 1)
    return first, last


def get_model(
    model_provider: Callable[..., torch.nn.Module], args: argparse.Namespace, grid: ProcessGrid
) -> list[DistributedDataParallel] | list[FSDP2DataParallel]:
    """One DDP- (or FSDP2-) wrapped chunk per virtual stage, with layout-independent
    initial weights."""
    vpp = args.virtual_pipeline_model_parallel_size
    stages = [None] if vpp is None else list(range(vpp))
    chunks = []
    for stage in stages:
        placement = "v" if getattr(args, "pipeline_schedule", None) == "zbv" else "loop"
        pre, post = stage_flags(grid, stage, vpp, placement)
        model = model_provider(pre, post, vp_stage=stage)
        init_weights_layout_independent(model, args.seed)
        if args.compile:  # in place, before the data-parallel wrapper (see compile.py)
            compile_layers(model, args.compile_backend)
        chunks.append(model)
    if args.use_torch_fsdp2:
        return [fsdp2_chunk(m, args, grid) for m in chunks]
    ddp = configs.ddp_config(args)
    return [DistributedDataParallel(ddp, m, grid=grid) for m in chunks]


_REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def fsdp2_chunk(model: torch.nn.Module, args, grid: ProcessGrid) -> FSDP2DataParallel:
    """Shard a chunk over dp x cp with FSDP2, one unit per transformer layer.

    The shards are the fp32 main params: with --bf16 the (bf16-initialised) params are
    widened before sharding and FSDP2 all-gathers them in bf16 for compute, reducing grads
    in fp32; the numerics of our mixed-precision optimizer over bf16 params. With
    --use-megatron-fsdp, --data-parallel-sharding-strategy optim_grads keeps the params
    gathered from forward to backward, and --megatron-fsdp-grad-comm-dtype picks the
    reduce dtype.
    """
    layers = model.get_submodule("decoder.layers")  # one FSDP unit per transformer layer
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(
            f"--use-torch-fsdp2: {type(model).__name__}.decoder.layers is a "
            f"{type(layers).__name__}; the rule: a ModuleList of the transformer layers"
        )
    compute = configs.params_dtype(args)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.float()
    return apply_fsdp2(
        model,
        grid.group("dp-cp"),
        param_dtype=None if compute == torch.float32 else compute,
        reduce_dtype=_REDUCE_DTYPES[args.fsdp_reduce_dtype or "fp32"],
        reshard_after_forward=args.fsdp_reshard_after_forward,
        blocks=list(layers),
        # every rank initialised the same weights (layout-independent init)
        broadcast_params=False,
        # experts split over ep shard over their own data-parallel ranks (edp)
        expert_dp=grid.group("edp") if grid.size("ep") > 1 else None,
    )


def setup_model_and_optimizer(model_provider, args, grid):
    """(chunks, optimizer, scheduler); checkpoint loading is the caller's next step."""
    chunks = get_model(model_provider, args, grid)
    optimizer = get_optimizer(configs.optimizer_config(args), chunks, grid=grid)
    scheduler = configs.scheduler(args, optimizer)
    return chunks, optimizer, scheduler


def build_iterators(loader_factory: Callable[[], Any], args, grid) -> list[Any]:
    """One iterator per model chunk (each chunk consumes its own copy of the stream);
    None on tp ranks other than 0, which receive their batches by broadcast."""
    n = args.virtual_pipeline_model_parallel_size or 1
    if grid.rank("tp") != 0:
        return [None] * n
    return [iter(loader_factory()) for _ in range(n)]
