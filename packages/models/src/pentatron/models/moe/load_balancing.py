"""Load-balancing losses of the MoE router and the trick that puts them into backward.

Each loss is computed from this rank's tokens only, as a *share*: summing the shares of the
ranks of the tp x cp group ("tp-cp") gives the loss of all their tokens, and summing their
router-weight grads over the group gives the grad of that loss (over tp: the all-reduce of
`sequence_parallel` params; over cp: the data-parallel reduction, as for every parameter). Only routing counts are all-reduced (no grad needed for them).

- switch (Switch Transformer): coeff * E * sum_i f_i P_i, f_i = assignments to expert i
  / (N * topk), P_i = mean prob of expert i, N = tokens of the group.
- sequence-level (DeepSeek-V2): the same per sequence, averaged over the batch.
- z-loss (ST-MoE): coeff * mean_tokens(logsumexp(logits)^2).
- sinkhorn: a doubly-stochastic normalisation used to choose experts (no loss).

`MoEAuxLossAutoScaler` attaches a loss to an activation: forward returns the activation
unchanged, backward additionally sends `aux_loss_scale` as the grad of the loss, so the
loss is back-propagated without being added to the main loss.
"""

from __future__ import annotations

from typing import Any

import torch

from pentatron.parallel_state import comm

# Module-level because the pipeline schedule sets it (PipelineConfig.aux_loss_scale_func =
# set_aux_loss_scale) once per micro-batch while the losses live deep inside the model, and
# the backward of every router must read the same value (Megatron keeps it as a class
# attribute of MoEAuxLossAutoScaler for the same reason). It must equal the factor the main
# loss is multiplied by before backward: loss scale / num_microbatches (or the loss scale
# alone in per-token mode).
_AUX_LOSS_SCALE: dict[str, torch.Tensor] = {"scale": torch.ones(())}


def set_aux_loss_scale(scale: torch.Tensor | float) -> None:
    """Set the grad the aux losses receive in backward (a 1-element tensor or a float)."""
    value = torch.as_tensor(scale, dtype=torch.float64).detach()
    if value.numel() != 1:
        raise ValueError(
            f"set_aux_loss_scale got a tensor of shape {tuple(value.shape)}; the rule: one "
            "element (loss scale / num_microbatches); fix: pass a scalar"
        )
    # Kept where it was made (the schedule makes it on the compute device): the routers'
    # backward reads it there without a host round trip.
    _AUX_LOSS_SCALE["scale"] = value.reshape(())


def get_aux_loss_scale() -> torch.Tensor:
    """The current aux-loss grad scale (a 0-dim float64 tensor; default 1 on the CPU)."""
    return _AUX_LOSS_SCALE["scale"]


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """`apply(activation, aux_loss)`: returns `activation`; backward gives aux_loss the grad
    `get_aux_loss_scale()` (read at backward time)."""

    @staticmethod
    def forward(ctx: Any, activation: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux_loss,) = ctx.saved_tensors
        scale = get_aux_loss_scale().to(device=aux_loss.device, dtype=aux_loss.dtype)
        return grad_output, torch.ones_like(aux_loss) * scale


def attach_aux_loss(activation: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """`activation`, unchanged, with `aux_loss` back-propagated alongside it."""
    return MoEAuxLossAutoScaler.apply(activation, aux_loss)


def _group_size(group: Any) -> int:
    if group is None or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group)


def _sum_over(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """all-reduce(group) of routing counts, without grad (they are not differentiated)."""
    counts = counts.detach().clone()
    if _group_size(group) > 1:
        comm.all_reduce(counts, group=group)
    return counts


def routing_scores_for_aux_loss(
    logits: torch.Tensor, topk: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, E]` logits -> (scores `[T, E]` over all experts, their top-k map `[T, E]` bool).

    As Megatron: the loss sees plain scores (softmax, or sigmoid normalised over the
    experts; in at least fp32) and their plain top-k: no expert bias, groups or capacity
    dropping.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)  # Megatron: fp32 scores
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=dtype)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.to(dtype))
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score_function={score_function!r}: one of ('softmax', 'sigmoid')")
    top = torch.topk(scores, k=topk, dim=-1).indices
    topk_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)
    return scores, topk_map


def switch_load_balancing_loss(
    scores: torch.Tensor, topk_map: torch.Tensor, topk: int, coeff: float, group: Any = None
) -> torch.Tensor:
    """This rank's share of coeff * E * sum_i f_i P_i over the tokens of `group`.

    `scores`, `topk_map`: `[T, E]` of this rank's T tokens; counts -> all-reduce(group);
    N = T * |group| (every rank of the group holds the same number of tokens).
    """
    num_tokens, num_experts = scores.shape
    counts = _sum_over(topk_map.sum(dim=0).to(scores.dtype), group)
    total = num_tokens * _group_size(group)
    weight = num_experts * coeff / (topk * total * total)
    return torch.sum(scores.sum(dim=0) * counts) * weight


def sequence_load_balancing_loss(
    scores: torch.Tensor,
    topk_map: torch.Tensor,
    batch_size: int,
    topk: int,
    coeff: float,
    group: Any = None,
) -> torch.Tensor:
    """This rank's share of the per-sequence switch loss, averaged over the batch.

    `scores`, `topk_map`: `[s_local * b, E]` (s-major); the group's ranks hold different
    positions of the same b sequences, so per-sequence counts `[b, E]` -> all-reduce(group)
    and the full length is S = s_local * |group|. Loss = coeff * mean_b sum_e
    (count[b, e] * E / (S * topk)) * mean_s(scores[s, b, e]).
    """
    num_experts = scores.shape[1]
    per_seq = scores.view(-1, batch_size, num_experts)
    seq_length = per_seq.shape[0] * _group_size(group)
    counts = topk_map.view(-1, batch_size, num_experts).sum(dim=0).to(scores.dtype)
    counts = _sum_over(counts, group)
    cost = counts * (num_experts / (seq_length * topk))
    return (cost * per_seq.sum(dim=0) / seq_length).sum(dim=1).mean() * coeff


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """coeff * mean over this rank's tokens of logsumexp(logits `[T, E]`)^2."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4, max_iters: int = 1000) -> torch.Tensor:
    """Sinkhorn-Knopp on exp(cost `[T, E]`): rows and columns rescaled alternately until the
    column factors move less than `tol` (mean abs change); returns the balanced matrix."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps = 1e-8
    for _ in range(max_iters):
        d0 = (1 / d0.size(0)) / (torch.sum(d1 * cost, 1) + eps)
        d1_new = (1 / d1.size(0)) / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_new - d1))
        d1 = d1_new
        if error <= tol:
            break
    return d1 * cost * d0.unsqueeze(1)
