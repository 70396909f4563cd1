"""`LanguageModelEmbedding`: vocab-parallel word embedding + optional learned positions.

    input_ids [b, s] -> word_embeddings (all-reduce(tp)) -> [b, s, h] (+ positions)
      -> transpose -> [s, b, h] -> (SP: scatter along s -> [s/t, b, h]) -> dropout
With sequence parallelism and no learned positions the word embedding reduce-scatters
straight to `[s/t, b, h]` (one collective instead of an all-reduce and a split).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from pentatron.tp_layers import (
    VocabParallelEmbedding,
    get_rng_tracker,
    init_method_normal,
    scatter_to_sequence_parallel_region,
)

from .config import TransformerConfig


class LanguageModelEmbedding(torch.nn.Module):
    """Megatron's embedding of a GPT; `vocab_size` is the padded vocabulary."""

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: str,
        tp_group: Any = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        self.reduce_scatter_embeddings = (
            config.sequence_parallel and not self.add_position_embedding
        )
        init = init_method_normal(config.init_method_std)
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size,
            config.hidden_size,
            tp_group=tp_group,
            init_method=init,
            reduce_scatter_embeddings=self.reduce_scatter_embeddings,
            params_dtype=config.params_dtype,
        )
        self.tp_group = self.word_embeddings.tp_group
        if self.add_position_embedding:
            self.position_embeddings = torch.nn.Embedding(
                max_sequence_length,
                config.hidden_size,
                dtype=config.params_dtype,
                device=self.word_embeddings.weight.device,
            )
            with torch.no_grad():
                master = torch.empty(max_sequence_length, config.hidden_size)
                init(master)
                self.position_embeddings.weight.copy_(master)
        self.max_sequence_length = max_sequence_length

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """ids `[b, s]`, positions `[b, s]` (None: 0..s-1) -> `[s, b, h]` (SP: `[s/t, b, h]`)."""
        emb = self.word_embeddings(input_ids)
        if self.add_position_embedding:
            if position_ids is None:
                position_ids = torch.arange(input_ids.size(1), device=input_ids.device)[None]
            emb = emb + self.position_embeddings(position_ids)
        if not self.reduce_scatter_embeddings:
            emb = emb.transpose(0, 1).contiguous()
        if self.config.fp32_residual_connection:
            emb = emb.float()
        p, sp = self.config.hidden_dropout, self.config.sequence_parallel
        if sp and not self.reduce_scatter_embeddings:
            # The scatter returns a view of the whole [s, b, h]; the first norm keeps its
            # input for backward, which would hold all of it: own the shard (as Megatron's
            # clone_scatter_output_in_embedding).
            emb = scatter_to_sequence_parallel_region(emb, self.tp_group).clone()
        with get_rng_tracker().fork() if sp and p > 0 else contextlib.nullcontext():
            return F.dropout(emb, p=p, training=self.training)
