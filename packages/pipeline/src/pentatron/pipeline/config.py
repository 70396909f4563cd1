"""`PipelineConfig`: what the schedules and the p2p layer need to know, validated up front.

Field names follow Megatron-LM's `ModelParallelConfig`, so a Megatron user recognises them.
`check_schedule` checks one call's sizes (micro-batches vs pipeline size, group size for
interleaving, sequence split) before any message is sent, so a bad call fails on every rank
alike with a message naming the field, the rule and a fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class PipelineConfigError(ValueError):
    """A pipeline setting that cannot work; the message names the field, the rule and a fix."""


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PipelineConfigError(
            f"{name}={value!r}: must be a positive integer; fix: set {name} >= 1"
        )


@dataclass
class PipelineConfig:
    """Settings of the pipeline schedules (Megatron's `ModelParallelConfig` subset).

    Tensors that cross a stage boundary have shape `[s / cp (/ tp with sequence
    parallel), b, hidden_size]` and dtype `pipeline_dtype`, unless `variable_seq_lengths`
    is set, in which case each message is preceded by a 3-element int64 shape message.

    Hooks (the optimizer package plugs in here; all optional):
      no_sync_func() -> context manager: entered while grads must only accumulate (every
        micro-batch but the last of each chunk).
      grad_sync_func(params): start the grad reduction of one chunk's params.
      param_sync_func(params): start the param all-gather of one chunk (interleaved only).
      finalize_model_grads_func(model_chunks, num_tokens | None): called once after the last
        backward (num_tokens is the step's total token count in per-token mode).
      grad_scale_func(loss) -> loss: loss scaling before the last stage's backward.
      aux_loss_scale_func(scale): called before each micro-batch's forward with the factor
        the main loss gets before backward (grad_scale_func(ones(1)) / num_microbatches, or
        without the division in per-token mode), so losses attached inside the model (MoE
        aux losses, e.g. pentatron.models.moe.load_balancing.set_aux_loss_scale) match it.
    Lists (one callable per chunk) are accepted for grad_sync_func / param_sync_func.

    weight_grad_store: for the zero-bubble schedules, an object with `defer()` (a context
      manager inside which the layers' backward queues weight gradients instead of computing
      them), `close_group()` (seal one micro-batch's queue), `run_oldest()` (run the
      oldest sealed one) and `clear()` (drop them all, after an error):
      `pentatron.tp_layers.WeightGradStore`.
    """

    hidden_size: int
    pipeline_dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False
    variable_seq_lengths: bool = False
    batch_p2p_comm: bool = True
    overlap_p2p_comm: bool = False
    deallocate_pipeline_outputs: bool = False
    calculate_per_token_loss: bool = False
    microbatch_group_size_per_vp_stage: int | None = None  # None: the pipeline size
    no_sync_func: Callable[[], Any] | None = None
    grad_sync_func: Any = None
    param_sync_func: Any = None
    finalize_model_grads_func: Callable[..., Any] | None = None
    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None
    aux_loss_scale_func: Callable[[torch.Tensor], None] | None = None
    weight_grad_store: Any = None

    def __post_init__(self) -> None:
        _positive("hidden_size", self.hidden_size)
        if not isinstance(self.pipeline_dtype, torch.dtype):
            raise PipelineConfigError(
                f"pipeline_dtype={self.pipeline_dtype!r}: must be a torch.dtype; "
                "fix: e.g. pipeline_dtype=torch.bfloat16"
            )
        if self.microbatch_group_size_per_vp_stage is not None:
            _positive("microbatch_group_size_per_vp_stage", self.microbatch_group_size_per_vp_stage)
        if self.overlap_p2p_comm and self.batch_p2p_comm:
            raise PipelineConfigError(
                "overlap_p2p_comm=True with batch_p2p_comm=True: overlapping starts single "
                "isend/irecv ahead of use, batching waits on a whole batch; the rule: at most "
                "one of them; fix: set batch_p2p_comm=False"
            )

    def group_size(self, pp: int) -> int:
        """Micro-batches per group in the interleaved schedule (default: pp)."""
        return self.microbatch_group_size_per_vp_stage or pp


def check_schedule(
    config: PipelineConfig,
    *,
    pp: int,
    vpp: int | None,
    num_microbatches: int,
    seq_length: int | None = None,
    tp: int = 1,
    cp: int = 1,
) -> None:
    """Raise `PipelineConfigError` if this call cannot be scheduled; communicates nothing."""
    _positive("num_microbatches", num_microbatches)
    _positive("pp", pp)
    if vpp is not None:
        _positive("vpp", vpp)
        if pp == 1:
            raise PipelineConfigError(
                f"vpp={vpp} with pp=1: virtual stages interleave chunks across pipeline ranks; "
                "fix: use pp > 1 or vpp=None"
            )
    if config.overlap_p2p_comm and vpp is None:
        raise PipelineConfigError(
            "overlap_p2p_comm=True without interleaving (vpp=None): as in Megatron-LM only the "
            "interleaved schedule overlaps p2p with compute; fix: set vpp or overlap_p2p_comm=False"
        )
    if vpp is not None:
        _check_group_size(config.group_size(pp), pp, num_microbatches)
    if seq_length is not None and not config.variable_seq_lengths:
        _check_sequence_split(config, seq_length, tp, cp)


def _check_group_size(group: int, pp: int, m: int) -> None:
    if not pp <= group <= m:
        raise PipelineConfigError(
            f"microbatch_group_size_per_vp_stage={group} with pp={pp}, num_microbatches={m}: "
            f"the rule: pp <= group size <= num_microbatches (Megatron-LM), so the interleaved "
            f"schedule needs num_microbatches >= pp; fix: use num_microbatches >= {pp} and a "
            f"group size in [{pp}, {max(pp, m)}]"
        )
    remainder = m % group
    if 0 < remainder < pp:
        raise PipelineConfigError(
            f"num_microbatches={m} with microbatch_group_size_per_vp_stage={group} leaves a "
            f"last group of {remainder} < pp={pp}; the rule: num_microbatches % group size is 0 "
            f"or >= pp (else the pipeline stalls on dependencies); fix: use a multiple of "
            f"{group} micro-batches, or a group size g with num_microbatches % g in {{0}} or >= {pp}"
        )


def _check_sequence_split(config: PipelineConfig, seq_length: int, tp: int, cp: int) -> None:
    _positive("seq_length", seq_length)
    split = cp * (tp if config.sequence_parallel else 1)
    if seq_length % split:
        what = "cp*tp (sequence_parallel=True)" if config.sequence_parallel else "cp"
        raise PipelineConfigError(
            f"seq_length={seq_length} is not divisible by {what} = {split}; the rule: each "
            f"rank's p2p tensor holds seq_length / {what} positions; fix: pad the sequence to a "
            f"multiple of {split} or set variable_seq_lengths=True"
        )


def tensor_shape(
    config: PipelineConfig, seq_length: int, micro_batch_size: int, tp: int = 1, cp: int = 1
) -> tuple[int, int, int]:
    """Shape of a tensor crossing a stage boundary: `[s / cp (/ tp), b, h]`."""
    s = seq_length // cp
    if config.sequence_parallel:
        s //= tp
    return (s, micro_batch_size, config.hidden_size)
