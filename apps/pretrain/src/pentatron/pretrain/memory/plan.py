"""`MemoryPlan`: everything the calculator needs about one run, from flags or a preset.

A plan is the validated `TransformerConfig` (which also carries tp, pp, vpp, cp, ep, etp,
sequence parallelism and recomputation) plus what lives outside it: vocabulary, sequence
length, micro-batch size and count, data-parallel size, precision, optimizer and DDP choices.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from pentatron.models import TransformerConfig
from pentatron.tp_layers import pad_vocab_size


class MemoryPlanError(ValueError):
    """A layout the calculator cannot size; the message names the field, rule and fix."""


DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


@dataclass
class MemoryPlan:
    """One training run's shape. `num_microbatches` m; `dp` data-parallel size."""

    config: TransformerConfig
    vocab_size: int
    seq_length: int
    micro_batch_size: int
    num_microbatches: int
    dp: int
    make_vocab_size_divisible_by: int = 128
    use_distributed_optimizer: bool = False
    use_torch_fsdp2: bool = False  # params, grads, optimizer state sharded over dp x cp
    pipeline_schedule: str = "1f1b"  # "zb-h1" / "zbv": the weight-gradient store too
    fsdp_reshard_after_forward: bool = True  # False: layers stay gathered fwd to bwd
    fsdp_reduce_bytes: int = 4  # the grad reduce-scatter's dtype
    grad_reduce_in_fp32: bool = True
    bucket_size: int | None = None  # resolved elements per bucket; None: one per buffer
    optimizer: str = "adam"
    name: str = "custom"
    max_position_embeddings: int | None = None  # learned positions' table; None: seq_length
    # torch.device type of the run; SDPA's grouped-k/v rule depends on it (models.sdpa)
    device: str = "cuda"

    def __post_init__(self) -> None:
        c = self.config
        modules = (
            set(c.recompute_modules or ()) if c.recompute_granularity == "selective" else set()
        )
        unsized = sorted(modules - {"core_attn", "mla_up_proj"})
        if unsized or (modules and "core_attn" not in modules):
            raise MemoryPlanError(
                f"--recompute-modules {' '.join(unsized or sorted(modules))}: selective "
                "recompute is sized for core_attn (with MLA, plus mla_up_proj) only; fix: "
                "size it without selective recompute (an upper bound), or measure it with "
                "torchrun -m pentatron.pretrain.memory.measure"
            )

    @property
    def tp(self) -> int:
        return self.config.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.config.pipeline_model_parallel_size

    @property
    def vpp(self) -> int:
        return self.config.virtual_pipeline_model_parallel_size or 1

    @property
    def cp(self) -> int:
        return self.config.context_parallel_size

    @property
    def ep(self) -> int:
        return self.config.expert_model_parallel_size

    @property
    def etp(self) -> int:
        return self.config.expert_tp_size

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: world / (etp * ep * pp)."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def padded_vocab_size(self) -> int:
        return pad_vocab_size(self.vocab_size, self.tp, self.make_vocab_size_divisible_by)

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.config.params_dtype]

    @property
    def grad_bytes(self) -> int:
        return 4 if self.grad_reduce_in_fp32 else self.param_bytes


def derive_dp(world_size: int, tp: int, pp: int, cp: int = 1, ep: int = 1, etp: int = 1) -> int:
    """dp = world / (tp*cp*pp), checked, and the expert grid etp*ep*pp must divide world."""
    if world_size < 1:
        raise MemoryPlanError(f"--world-size={world_size}: must be >= 1; fix: pass a positive N")
    if world_size % (tp * cp * pp):
        raise MemoryPlanError(
            f"--world-size={world_size}: must be divisible by tp*cp*pp = {tp}*{cp}*{pp} = "
            f"{tp * cp * pp}; fix: use a multiple of {tp * cp * pp} or change the sizes"
        )
    if world_size % (etp * ep * pp):
        raise MemoryPlanError(
            f"--world-size={world_size}: must be divisible by etp*ep*pp = {etp}*{ep}*{pp}; "
            "fix: change --expert-model-parallel-size or the world size"
        )
    return world_size // (tp * cp * pp)


def plan_from_args(args: argparse.Namespace) -> MemoryPlan:
    """A plan from `validate_args`-checked pentatron-pretrain arguments (the app's rules)."""
    from ..training import configs

    ddp = configs.ddp_config(args)
    return MemoryPlan(
        config=configs.transformer_config(args),
        vocab_size=args.vocab_size or 4096,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        num_microbatches=args.num_microbatches,
        dp=args.data_parallel_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        use_distributed_optimizer=args.use_distributed_optimizer,
        use_torch_fsdp2=args.use_torch_fsdp2,
        pipeline_schedule=getattr(args, "pipeline_schedule", None) or "1f1b",
        fsdp_reshard_after_forward=getattr(args, "fsdp_reshard_after_forward", True),
        fsdp_reduce_bytes=4 if getattr(args, "fsdp_reduce_dtype", None) in (None, "fp32") else 2,
        grad_reduce_in_fp32=ddp.grad_reduce_in_fp32,
        bucket_size=ddp.resolved_bucket_size(args.data_parallel_size),
        optimizer=args.optimizer,
        max_position_embeddings=args.max_position_embeddings,
        device="cpu" if args.device == "cpu" else "cuda",  # auto: the GPU run being sized
    )
