"""`VocabParallelEmbedding`: the embedding table split along the vocabulary over tp.

Rank r holds rows `[r V/t, (r+1) V/t)`. Each rank looks up the ids it owns, writes zeros for
the others, and the partial embeddings are summed over tp:

    ids [b, s] -> local lookup, foreign ids masked -> partial [b, s, h]
      -> all-reduce(tp) -> [b, s, h]
      or (reduce_scatter_embeddings) transpose -> [s, b, h] -> reduce-scatter(tp) -> [s/t, b, h]

The lookup's backward is autograd's own (`embedding_dense_backward`, the table's gradient
from the ids and the output gradient `[b, s, h]`), run now or, inside a zero-bubble
schedule's B (`WeightGradStore.defer()`), queued as part of the micro-batch's W.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pentatron.parallel_state import current_device

from .init import InitMethod, init_method_normal, init_sharded_
from .mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from .utils import (
    TPConfigError,
    group_rank,
    group_size,
    resolve_group,
    set_tensor_model_parallel_attributes,
    vocab_range,
)


def check_token_ids(ids: torch.Tensor, vocab_size: int, what: str) -> None:
    """Fail on ids outside `[0, vocab_size)`: sharded lookups would silently give zeros.

    On the host the check is exact and raises `TPConfigError`. On an accelerator it is an
    asynchronous device assertion (`torch._assert_async`): no host sync per micro-batch, a
    device-side assert if an id is out of range (check ids on the host, before the copy,
    for a readable error: the training app does).
    """
    if ids.is_floating_point() or ids.is_complex():
        raise TPConfigError(f"{what}: token ids have dtype {ids.dtype}; fix: pass integer ids")
    if ids.numel() == 0:
        return
    if ids.device.type != "cpu":
        ok = ((ids >= 0) & (ids < vocab_size)).all()
        torch._assert_async(ok, f"{what}: a token id is outside [0, {vocab_size})")
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise TPConfigError(
            f"{what}: token id {bad} is outside the vocabulary [0, {vocab_size}); the rule: "
            f"every id indexes a row of the (padded) vocabulary; fix: check the tokenizer's "
            f"vocab size against the model's vocabulary size {vocab_size}"
        )


class _Lookup(torch.autograd.Function):
    """`F.embedding(ids, weight)` whose weight gradient can be deferred to a W."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None]:
        from .layers.weight_grad_store import DeferredWeightGrad, deferring_store

        (ids,) = ctx.saved_tensors
        weight = ctx.weight

        def weight_grad() -> torch.Tensor:  # autograd's formula for F.embedding's weight
            return torch.ops.aten.embedding_dense_backward(grad, ids, weight.size(0), -1, False)

        store = deferring_store()
        if not ctx.needs_input_grad[1]:
            return None, None
        if store is None:
            return None, weight_grad()
        nbytes = sum(t.numel() * t.element_size() for t in (ids, grad))
        store.push(DeferredWeightGrad(lambda: [(weight, weight_grad())], nbytes))
        return None, None


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding with the vocabulary sharded over tp (Megatron's `VocabParallelEmbedding`).

    Args:
        num_embeddings: the full (padded) vocabulary size; must divide by t, see
            `pad_vocab_size`.
        embedding_dim: hidden size h.
        tp_group: ProcessGroup, DeviceMesh or (mesh, dim); None: the default grid's tp.
        init_method: fills the full `[V, h]` master table (default N(0, 0.02^2)).
        reduce_scatter_embeddings: return `[s/t, b, h]` for sequence parallelism.
        check_ids: validate ids (one host sync per call); off only for speed.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_group: Any = None,
        init_method: InitMethod | None = None,
        reduce_scatter_embeddings: bool = False,
        check_ids: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.tp_group = resolve_group(tp_group)
        self.tp_size = group_size(self.tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start_index, self.vocab_end_index = vocab_range(
            num_embeddings, group_rank(self.tp_group), self.tp_size
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.reduce_scatter_embeddings, self.check_ids = reduce_scatter_embeddings, check_ids
        weight = torch.empty(
            (self.num_embeddings_per_partition, embedding_dim),
            dtype=params_dtype or torch.get_default_dtype(),
            device=device or current_device(),
        )
        init_sharded_(
            weight,
            (num_embeddings, embedding_dim),
            init_method or init_method_normal(0.02),
            0,
            group_rank(self.tp_group),
            self.tp_size,
        )
        self.weight = torch.nn.Parameter(weight)
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids `[b, s]` -> `[b, s, h]`, or `[s/t, b, h]` with `reduce_scatter_embeddings`."""
        if self.check_ids:
            check_token_ids(ids, self.num_embeddings, "VocabParallelEmbedding")
        if self.tp_size > 1:
            foreign = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            local_ids = (ids - self.vocab_start_index).masked_fill(foreign, 0)
        else:
            foreign, local_ids = None, ids
        partial = _Lookup.apply(local_ids, self.weight)
        if foreign is not None:
            partial = partial.masked_fill(foreign.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            # The rest of a sequence-parallel model is [s, b, h]-major.
            partial = partial.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        return reduce_from_tensor_model_parallel_region(partial, self.tp_group)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"tp={self.tp_size}, shard=[{self.vocab_start_index}, {self.vocab_end_index})"
        )
