"""One training step and the evaluation loop over the model chunks of this rank.

`train_step`: zero the grad buffers, run the pipeline schedule (forward and backward of
every micro-batch), finalize the grads (dp reduction, tied embeddings, sequence-parallel
norms), step the optimizer unless the loss was not finite, and return what the logger
needs. MoE models also update the routers' expert biases after the optimizer step (the
same on every rank) and report each layer's aux losses, averaged over micro-batches and
the ranks that saw the tokens. The step's verdict (loss finite?) is agreed by every rank with one all-reduce, so a
NaN on the last stage never leaves the other stages waiting in a collective. Flags, loss and
norms are computed and reduced on the grid's device; the step reads them on the host once
(plus the optimizer's grad norm), never per micro-batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pentatron.models import (
    collect_moe_aux_losses,
    reset_expert_bias_counts,
    reset_moe_aux_losses,
    update_expert_bias,
)
from pentatron.optim import finalize_model_grads
from pentatron.parallel_state import ProcessGrid, comm
from pentatron.pipeline import PipelineConfig, get_forward_backward_func
from pentatron.tp_layers import WeightGradStore


@dataclass
class StepOutput:
    loss: float | None  # dp-averaged per-token loss (last pipeline stage), else None
    finite: bool  # the loss was finite on every rank
    update_successful: bool
    grad_norm: float | None
    num_zeros: int | None
    moe_losses: dict[str, list[float]] | None = None  # name -> per-layer value (MoE only)
    mtp_losses: dict[str, float | None] | None = None  # "mtp_<k> loss" -> mean (last stage)


def _loss_pair(
    reduced: list[dict[str, torch.Tensor]], grid: ProcessGrid, zbv: bool = False
) -> torch.Tensor | None:
    """(loss sum, token count) of the micro-batches, summed over dp: float64 `[2]` on the
    device (no host read), on the last pipeline rank; None elsewhere. `zbv`: the loss was
    computed on pipeline rank 0 (the V's last stage) and is moved to the last rank, where
    the logger and every caller read it for all schedules (collective over pp)."""
    total = None
    if reduced:
        total = torch.stack([r["lm loss"] for r in reduced]).sum(0).double()
        comm.all_reduce(total, group=grid.group("dp"))
    return _to_last_pipeline_rank(total, grid) if zbv else total


def _to_last_pipeline_rank(total: torch.Tensor | None, grid: ProcessGrid) -> torch.Tensor | None:
    """Pipeline rank 0's `[2]` pair, on the last pipeline rank (one broadcast over pp)."""
    ranks, me = grid.ranks("pp"), grid.rank("pp")
    if me == 0 and total is None:
        raise RuntimeError("ZBV: pipeline rank 0 (the V's last stage) computed no loss")
    buf = total if me == 0 else torch.empty(2, dtype=torch.float64, device=grid.device)
    comm.broadcast(buf, src=ranks[0], group=grid.group("pp"))
    return buf if me == len(ranks) - 1 else None


def is_zbv(args) -> bool:
    return getattr(args, "pipeline_schedule", None) == "zbv"


def _mtp_pairs(reduced: list[dict[str, torch.Tensor]], grid: ProcessGrid) -> torch.Tensor | None:
    """`[D, 2]` (loss sum, token count) of each MTP depth, summed over micro-batches and dp
    like the lm loss's; None without MTP or off the last stage."""
    names = sorted((k for k in reduced[0] if k.startswith("mtp_")), key=_depth) if reduced else []
    if not names:
        return None
    total = torch.stack([torch.stack([r[k] for k in names]) for r in reduced]).sum(0).double()
    comm.all_reduce(total, group=grid.group("dp"))
    return total


def _depth(name: str) -> int:
    return int(name.split("_", 1)[1].split(" ", 1)[0])  # "mtp_<k> loss" -> k


def _mean(pair: list[float] | None) -> float | None:
    return None if pair is None else pair[0] / max(pair[1], 1.0)


def reduce_losses(
    reduced: list[dict[str, torch.Tensor]], grid: ProcessGrid, zbv: bool = False
) -> float | None:
    """Per-token mean of the micro-batches' (loss sum, tokens) pairs over dp on the last
    pipeline rank, or None."""
    pair = _loss_pair(reduced, grid, zbv)
    return _mean(None if pair is None else pair.tolist())


def agree_flags(flags: list[bool], grid: ProcessGrid, group: Any = None) -> list[bool]:
    """Any-rank OR of host-side flags (signals, clocks, writer threads) over the whole
    world: one all-reduce of CPU values on the grid's host group (gloo)."""
    t = torch.tensor([float(f) for f in flags])
    comm.all_reduce(t, op=comm.ReduceOp.MAX, group=group if group is not None else grid.host_group)
    return [bool(v) for v in t]


def aux_loss_scale_func(grid: ProcessGrid) -> Callable[[torch.Tensor], None]:
    """What the schedule calls with the main loss's grad factor: the models' attached
    losses (MoE aux losses, MTP) get it times cp. They are shares that add up over the cp
    ranks, and DDP averages grads over dp x cp (the main loss is multiplied by cp in
    loss_func for the same reason; Megatron scales the MoE aux loss by cp too)."""
    from pentatron.models import set_aux_loss_scale

    cp = grid.size("cp")
    return lambda scale: set_aux_loss_scale(scale * cp)


def make_pipeline_config(
    args, chunks, grid: ProcessGrid, make: Callable, optimizer: Any
) -> PipelineConfig:
    """The schedule's hooks wired to DDP: no_sync on every chunk, overlap-started grad sync,
    finalize (with per-token scaling when --calculate-per-token-loss), and with --fp16 the
    optimizer's loss scale on the loss before backward (the optimizer divides it out)."""

    @contextlib.contextmanager
    def no_sync():
        with contextlib.ExitStack() as stack:
            for c in chunks:
                stack.enter_context(c.no_sync())
            yield

    def finalize(model_chunks, num_tokens):
        finalize_model_grads(chunks, grid=grid)
        if num_tokens is not None:
            # Tokens live on the last stage; sum over pp (others add 0) and dp. DDP averaged
            # over dp, so the sum of grads is dp times what it holds. The factor stays on
            # the device: no host read in the step.
            n = num_tokens.to(torch.float64)
            comm.all_reduce(n, group=grid.group("pp"))
            comm.all_reduce(n, group=grid.group("dp"))
            factor = grid.size("dp") / n.clamp(min=1.0)
            for c in chunks:
                c.scale_gradients(factor)

    hooks: dict[str, Any] = {"no_sync_func": no_sync, "finalize_model_grads_func": finalize}
    if getattr(args, "num_experts", None) or getattr(args, "mtp_num_layers", None):
        hooks["aux_loss_scale_func"] = aux_loss_scale_func(grid)
    if getattr(args, "pipeline_schedule", None) in ("zb-h1", "zbv"):
        hooks["weight_grad_store"] = WeightGradStore()
    if args.fp16:
        hooks["grad_scale_func"] = optimizer.scale_loss
    if args.overlap_grad_reduce:
        hooks["grad_sync_func"] = [lambda params, c=c: c.start_grad_sync() for c in chunks]
    return make(args, **hooks)


def run_schedule(
    args,
    chunks,
    iterators,
    forward_step,
    pcfg,
    grid,
    num_microbatches,
    *,
    forward_only: bool = False,
) -> list[dict[str, torch.Tensor]]:
    vpp = args.virtual_pipeline_model_parallel_size
    func = get_forward_backward_func(
        args.pipeline_model_parallel_size, vpp, getattr(args, "pipeline_schedule", None)
    )
    return func(
        forward_step_func=forward_step,
        data_iterator=iterators if vpp else iterators[0],
        model=chunks if vpp else chunks[0],
        num_microbatches=num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        config=pcfg,
        grid=grid,
        forward_only=forward_only,
    )


def _nonfinite_flags(reduced, chunks, grid: ProcessGrid, check_grads: bool) -> torch.Tensor:
    """[bad loss, bad grads] on the device, 1.0 where some rank saw a NaN/Inf (last stage's
    loss; with `check_grads`, any grad buffer), agreed by one all-reduce (MAX) over the world,
    so every rank takes the same decision before the optimizer touches a parameter."""
    flags = torch.zeros(2, dtype=torch.float64, device=grid.device)
    if reduced:
        losses = torch.stack([r["lm loss"] for r in reduced])
        flags[0] = (~torch.isfinite(losses)).any()
    if check_grads:
        grads = [g for c in chunks for g in c.local_grads()]
        if grads:
            flags[1] = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any()
    comm.all_reduce(flags, op=comm.ReduceOp.MAX)
    return flags


def train_step(
    args, chunks, iterators, forward_step, optimizer, pcfg, grid, num_microbatches: int
) -> StepOutput:
    for c in chunks:
        c.zero_grad_buffer()
    reduced = run_schedule(args, chunks, iterators, forward_step, pcfg, grid, num_microbatches)
    flags = _nonfinite_flags(reduced, chunks, grid, args.check_for_nan_in_loss_and_grad)
    pair, mtp = _loss_pair(reduced, grid, is_zbv(args)), _mtp_pairs(reduced, grid)
    # The step's one host read before the optimizer (which reads the grad norm).
    parts = [flags] + ([] if pair is None else [pair]) + ([] if mtp is None else [mtp.flatten()])
    host = torch.cat(parts).tolist()
    finite = not (host[0] or host[1])
    loss = _mean(host[2:4] or None)
    mtp_losses: dict[str, float | None] | None = None
    if mtp is not None:
        values = host[4:]
        mtp_losses = {
            f"mtp_{k + 1} loss": _mean(values[2 * k : 2 * k + 2]) for k in range(len(values) // 2)
        }
    moe = _moe_losses(args, chunks, grid)
    if not finite:
        _expert_bias_step(args, chunks, grid, applied=False)
        return StepOutput(loss, False, False, None, None, moe, mtp_losses)
    result = optimizer.step()
    _expert_bias_step(args, chunks, grid, applied=result.update_successful)
    return StepOutput(
        loss,
        True,
        result.update_successful,
        result.grad_norm,
        result.num_zeros_in_grad,
        moe,
        mtp_losses,
    )


def _expert_bias_step(args, chunks, grid: ProcessGrid, applied: bool) -> None:
    """MoE aux-loss-free balancing: move the expert biases after an applied update (the same
    on every rank), else drop this step's counts so they never reach the next update."""
    if not getattr(args, "num_experts", None):
        return
    if applied:
        update_expert_bias(chunks, grid.group("tp-dp-cp"))
    else:
        reset_expert_bias_counts(chunks)


def _moe_losses(args, chunks, grid: ProcessGrid) -> dict[str, list[float]] | None:
    """This step's per-layer aux losses (collective over pp and tp-dp-cp), then reset."""
    if not getattr(args, "num_experts", None):
        return None
    losses = collect_moe_aux_losses(chunks, grid)
    reset_moe_aux_losses(chunks)
    return {name: [float(v) for v in values] for name, values in losses.items()}


@torch.no_grad()
def evaluate(
    args, chunks, iterators, forward_step, pcfg, grid, eval_iters: int, num_microbatches: int
) -> float | None:
    """Mean per-token validation loss over `eval_iters` global batches (last stage)."""
    for c in chunks:
        c.eval()
    reduced: list[dict[str, torch.Tensor]] = []
    try:
        for _ in range(eval_iters):
            reduced += run_schedule(
                args,
                chunks,
                iterators,
                forward_step,
                pcfg,
                grid,
                num_microbatches,
                forward_only=True,
            )
    finally:
        for c in chunks:
            c.train()
            c.reshard()  # FSDP2: back to this rank's shards (no backward resharded them)
    return reduce_losses(reduced, grid, is_zbv(args))
