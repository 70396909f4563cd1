"""The GPT callbacks of Megatron's pretrain_gpt.py: get_batch, loss_func, forward_step.

Each is small and replaceable; `pretrain()` takes `forward_step_func` as an argument.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from pentatron.models.context_parallel import get_batch_on_this_cp_rank
from pentatron.parallel_state import ProcessGrid, comm
from pentatron.tp_layers import check_token_ids

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module"):
        model = model.module
    return model


def get_batch(
    data_iterator, model, grid: ProcessGrid, micro_batch_size: int, seq_length: int
) -> dict[str, torch.Tensor] | None:
    """This chunk's micro-batch: tokens, labels, loss_mask, position_ids, each [b, s].

    Only chunks that embed (first stage, an MTP stage) or compute the loss (last stage) need
    data; others get None and do not advance their iterator. Only tp rank 0 reads, straight
    into one int64 [4, b, s] tensor on the grid's device; one broadcast over tp gives the
    other tp ranks the same batch. With context parallelism each tensor is then cut to this cp rank's load-balanced chunks, [b, s/cp] (position_ids
    keep their global values).
    """
    chunk = _unwrap(model)
    # (a standalone MTP stage embeds the shifted inputs: it reads the batch too)
    if not (chunk.pre_process or chunk.post_process or getattr(chunk, "mtp_process", False)):
        return None
    tp = grid.size("tp")
    packed = torch.empty(
        (len(BATCH_KEYS), micro_batch_size, seq_length), dtype=torch.int64, device=grid.device
    )
    if grid.rank("tp") == 0:
        batch = next(data_iterator)
        for key in ("tokens", "labels"):  # on the host, so the GPU never asserts on them
            check_token_ids(batch[key], chunk.padded_vocab_size, f"the data's {key}")
        for row, key in zip(packed, BATCH_KEYS):
            # Host -> device without waiting for the device (the loader pins its batches
            # on CUDA); the loss mask's 0/1 survive the int64 round trip exactly.
            row.copy_(batch[key], non_blocking=True)
    if tp > 1:
        src = grid.ranks("tp")[0]
        comm.broadcast(packed, src=src, group=grid.group("tp"))
    out = dict(zip(BATCH_KEYS, packed.unbind(0)))
    out["loss_mask"] = out["loss_mask"].float()
    return get_batch_on_this_cp_rank(out, grid.size("cp"), grid.rank("cp"))


def loss_func(
    loss_mask: torch.Tensor | None,
    output: torch.Tensor,
    cp_group: Any = None,
    mtp_report: list[torch.Tensor] | None = None,
):
    """Masked per-token loss: (sum of losses, token count, {"lm loss": [sum, count]}).

    `output` is the model's per-token loss [b, s] ([b, s/cp] with context parallelism). The
    schedule divides by the token count (or, with --calculate-per-token-loss, the step's
    total); the reported pair lets the logger average over micro-batches and dp exactly. A
    NaN/Inf stays in the report: the training step agrees on it across ranks and stops or
    skips.

    With cp > 1 (`cp_group`), [sum, count] is all-reduced over cp so the count and the
    report cover the whole sequence, and the differentiable loss is this rank's sum times
    cp: DDP averages grads over dp x cp, so the cp ranks' grads add up to the grad of the
    full sequence's sum (Megatron's rule), in both per-micro-batch and per-token modes.
    `loss_mask` is None only on chunks that compute no loss (`forward_step` binds it).
    `mtp_report`: the model's MTP depths' [sum, count] (already over cp), reported as
    `"mtp_<k> loss"` beside "lm loss" (their grads are attached inside the model).
    """
    if loss_mask is None:
        raise ValueError(
            "loss_func without a loss mask: only a chunk with post_process computes the loss, "
            "and get_batch gives it the mask"
        )
    mask = loss_mask.reshape(-1).float()
    losses = output.float().reshape(-1)
    loss = torch.sum(losses * mask)
    pair = torch.stack([loss.detach().clone(), mask.sum().detach()])
    cp = 1 if cp_group is None else torch.distributed.get_world_size(cp_group)
    if cp > 1:
        comm.all_reduce(pair, group=cp_group)
        loss = loss * cp
    num_tokens = pair[1].to(torch.int)
    reported = {"lm loss": pair}
    for depth, mtp_pair in enumerate(mtp_report or (), start=1):
        reported[f"mtp_{depth} loss"] = mtp_pair
    return loss, num_tokens, reported


def forward_step(
    data_iterator, model, *, grid: ProcessGrid, micro_batch_size: int, seq_length: int
):
    """Megatron's forward_step: (output, loss_func bound to this micro-batch's mask)."""
    batch = get_batch(data_iterator, model, grid, micro_batch_size, seq_length)
    chunk = _unwrap(model)
    embeds = chunk.pre_process or getattr(chunk, "mtp_process", False)  # MTP embeds too
    tokens = batch["tokens"] if batch is not None and embeds else None
    position_ids = batch["position_ids"] if batch is not None and embeds else None
    labels = batch["labels"] if batch is not None and chunk.post_process else None
    mask = batch["loss_mask"] if batch is not None else None
    output = model(
        tokens, position_ids, labels=labels, loss_mask=mask if labels is not None else None
    )
    cp_group = grid.group("cp") if grid.size("cp") > 1 else None
    report = getattr(chunk, "mtp_report", None)
    return output, partial(loss_func, mask, cp_group=cp_group, mtp_report=report)


def make_forward_step(grid: ProcessGrid, micro_batch_size: int, seq_length: int):
    return partial(
        forward_step, grid=grid, micro_batch_size=micro_batch_size, seq_length=seq_length
    )
