"""Cross-entropy over logits sharded along the vocabulary, without gathering them.

    logits [s, b, V/t] on each rank
      -> local softmax p (one fused kernel) and local log-sum-exp [s, b]
      -> all-reduce(MAX, tp) of the local log-sum-exps [s, b]
      -> (target logit, sum exp(lse_r - max), [sum of logits]) -> one all-reduce(SUM) [2|3, s, b]
      -> per-token loss [s, b]; p rescaled to the global softmax, saved for backward

So the forward moves O(s*b) elements and the backward none: the gradient
`softmax - (1-eps) onehot - eps/V` is formed from the local shard alone. The local
log-sum-exp is read off the softmax: its largest entry is exp(max - lse), so lse = max -
log(max p), two cheap reductions instead of separate max, exp and sum passes over [s, b, V/t].
Label smoothing follows torch.nn.functional.cross_entropy: `(1-eps) * nll + eps *
mean_j(-log p_j)`, the mean over the full vocabulary V (found with the same all-reduce, not
over the local shard).
"""

from __future__ import annotations

from typing import Any

import torch

from pentatron.parallel_state import comm

from .embedding import check_token_ids
from .utils import TPConfigError, group_rank, group_size, resolve_group


def _all_reduce(x: torch.Tensor, group: Any, op: Any) -> None:
    if group_size(group) > 1:
        comm.all_reduce(x, op=op, group=group)


def _local_target(target: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, Any]:
    """Target ids relative to this shard (0 where foreign) and the mask of foreign ones."""
    foreign = (target < start) | (target >= end)
    return (target - start).masked_fill(foreign, 0), foreign


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any, label_smoothing: float
    ) -> torch.Tensor:
        n, rank = group_size(group), group_rank(group)
        part = logits.size(-1)
        vocab = part * n
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))
        softmax = torch.softmax(x, dim=-1)  # of this shard; rescaled below when t > 1
        lse = x.amax(dim=-1) - softmax.amax(dim=-1).log()  # this shard's log-sum-exp
        local_t, foreign = _local_target(target, rank * part, (rank + 1) * part)
        predicted = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(foreign, 0.0)
        if n > 1:
            top = lse.clone()
            _all_reduce(top, group, comm.ReduceOp.MAX)  # exp(lse - top) cannot overflow
            parts = [predicted, (lse - top).exp()]
        else:
            top, parts = lse, [predicted]
        if label_smoothing > 0:
            parts.append(x.sum(dim=-1))
        stats = torch.stack(parts)
        _all_reduce(stats, group, comm.ReduceOp.SUM)  # one small collective for all sums
        log_z = top + stats[1].log() if n > 1 else lse
        loss = log_z - stats[0]
        if label_smoothing > 0:
            mean_log_p = stats[-1] / vocab - log_z
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_p
        if n > 1:  # the shard's softmax times its share of the global normaliser
            softmax.mul_((lse - log_z).exp().unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, foreign)
        ctx.label_smoothing, ctx.vocab, ctx.in_dtype = label_smoothing, vocab, logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, None, None, None]:
        softmax, local_t, foreign = ctx.saved_tensors
        eps = ctx.label_smoothing
        g = grad_loss.unsqueeze(-1)
        # One pass over [s, b, V/t] into a new tensor (the saved softmax stays intact for a
        # retained graph); the one-hot and smoothing terms are then small or in place.
        grad = softmax * g
        own = (~foreign).to(softmax.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -(1.0 - eps) * own * g)
        if eps > 0:
            grad.sub_((eps / ctx.vocab) * g)
        return grad.to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: Any = None,
    *,
    label_smoothing: float = 0.0,
    check_targets: bool = True,
) -> torch.Tensor:
    """Per-token loss `[s, b]` from logits `[s, b, V/t]` sharded over `tp_group` (see module doc).

    `target` `[s, b]` holds ids of the full vocabulary `V = t * V/t`. `check_targets`
    rejects ids outside `[0, V)` (exactly on the host; an async device assertion on an
    accelerator, see `check_token_ids`), which would otherwise give a wrong loss.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise TPConfigError(
            f"label_smoothing={label_smoothing}: the rule: 0 <= label_smoothing < 1; "
            "fix: e.g. label_smoothing=0.1"
        )
    if tuple(target.shape) != tuple(vocab_parallel_logits.shape[:-1]):
        raise TPConfigError(
            f"target shape {tuple(target.shape)} does not match logits "
            f"{tuple(vocab_parallel_logits.shape)}; the rule: target is logits.shape[:-1]; "
            "fix: pass one target id per logits row"
        )
    group = resolve_group(tp_group)
    if check_targets:
        vocab = vocab_parallel_logits.size(-1) * group_size(group)
        check_token_ids(target, vocab, "vocab_parallel_cross_entropy")
    return _VocabParallelCrossEntropy.apply(
        vocab_parallel_logits, target, group, float(label_smoothing)
    )
