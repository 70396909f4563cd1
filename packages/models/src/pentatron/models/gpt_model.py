"""`GPTModel`: embedding -> TransformerBlock (this chunk's layers) -> final norm -> output
layer -> vocab-parallel loss, at any tp / sp / pp / vpp layout of a `ProcessGrid`.

Activations inside are `[s, b, h]` (`[s/t, b, h]` with sequence parallelism); a pipeline
chunk that is not the last stage returns that tensor for the next stage. The last stage
returns, as Megatron-LM does:
- without labels: logits `[b, s, V_pad / t]` sharded along the vocabulary over tp
  (`parallel_output=True`), or `[b, s, V_pad]` all-gathered over tp with
  `gather_logits=True` (or `parallel_output=False`); take `[..., :model.vocab_size]` for the
  real vocabulary (rows past it are Megatron's padding);
- with labels `[b, s]`: the per-token cross-entropy `[b, s]` (fp32), computed on the
  sharded logits without gathering them.

Tied input/output embeddings (`share_embeddings_and_output_weights`, default: not
`config.untie_embeddings_and_output_weights`): with one stage the output layer reads
`embedding.word_embeddings.weight`; with pp > 1 the last stage keeps a copy in
`output_layer.weight`, set equal to the first stage's at construction (zero-fill +
all-reduce over the grid's embedding group). Both copies carry `shared_embedding=True`,
so `sync_grads` (or pentatron.optim's finalize_model_grads) all-reduces their grads over
the embedding group and an optimizer step keeps them identical.

Multi-token prediction (`config.mtp_num_layers`, mtp.py) runs on the last stage after the
final norm, in training with labels; it needs the embedding there, so with pp > 1 the last
stage holds a copy of the embedding (word and learned position tables), tied to the first
stage's as above, and a tied output layer reads that copy. `forward` then also takes the
input ids and positions on the last stage, and `loss_mask`; each depth's (loss sum, token
count) of the last forward is in `mtp_report`. A custom layout may put MTP on a stage of
its own before the loss's (`config.mtp_standalone`): that stage holds the final norm, the
embedding copy (its rank must be in the embedding group) and the MTP layers, and returns
`[(1 + D) s(/t), b, h]` (h_0 and each depth's output) in training; the loss's stage splits
it and attaches the MTP losses, so its messages change length (variable_seq_lengths).
"""

from __future__ import annotations

from typing import Any

import torch

from pentatron.parallel_state import ProcessGrid, comm, current_device
from pentatron.tp_layers import (
    ColumnParallelLinear,
    gather_from_tensor_model_parallel_region,
    init_method_normal,
    pad_vocab_size,
    vocab_parallel_cross_entropy,
)

from .config import ROTARY_EMBEDDINGS, ModelConfigError, TransformerConfig
from .context_parallel import cp_positions
from .embedding import LanguageModelEmbedding
from .mtp import MultiTokenPredictionBlock, mtp_loss
from .parallel import ModelParallel
from .rope import RotaryEmbedding
from .transformer_block import TransformerBlock


class GPTModel(torch.nn.Module):
    """Megatron-LM's GPTModel (see the module docstring for inputs, outputs and tying).

    Args:
        config: the TransformerConfig (its parallel sizes must match `grid`).
        transformer_layer_spec: e.g. `get_gpt_layer_local_spec()`.
        vocab_size: the real vocabulary; padded to a multiple of
            `make_vocab_size_divisible_by * tp` (`padded_vocab_size`).
        max_sequence_length: rows of the learned position embedding.
        pre_process / post_process: this chunk holds the embedding / the output layer and
            loss; None derives them from the grid (first / last virtual stage).
        grid: the ProcessGrid (None: the default grid, or a single process).
        vp_stage: the virtual pipeline stage of this chunk (with vpp).
    """

    def __init__(
        self,
        config: TransformerConfig,
        transformer_layer_spec: Any,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool | None = None,
        post_process: bool | None = None,
        share_embeddings_and_output_weights: bool | None = None,
        parallel_output: bool = True,
        make_vocab_size_divisible_by: int = 128,
        position_embedding_type: str | None = None,
        grid: ProcessGrid | None = None,
        vp_stage: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = par = ModelParallel.resolve(config, grid, vp_stage)
        chunks = config.virtual_pipeline_model_parallel_size or 1
        self.pre_process = par.is_first_stage() if pre_process is None else pre_process
        if post_process is None:
            post_process = par.is_last_stage(chunks, config.pipeline_placement)
        self.post_process = post_process
        # MTP sits on the last stage, or on a custom layout's standalone MTP stage
        self.mtp_process = config.mtp_on(par.pp_rank, vp_stage, self.post_process)
        self.final_norm_here = config.final_norm_on(par.pp_rank, vp_stage, self.post_process)
        self.mtp_standalone = config.mtp_standalone  # read once: forward branches on it
        self.mtp_report: list[torch.Tensor] = []
        self.vp_stage = vp_stage
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.padded_vocab_size = pad_vocab_size(
            vocab_size, par.tp_size, make_vocab_size_divisible_by
        )
        self.position_embedding_type = position_embedding_type or config.position_embedding_type
        if share_embeddings_and_output_weights is None:
            share_embeddings_and_output_weights = config.share_embeddings_and_output_weights
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.parallel_output = parallel_output
        self._build(transformer_layer_spec)
        self._setup_tied_output_weight()

    def _build(self, spec: Any) -> None:
        config, par = self.config, self.parallel
        if self.pre_process or self.mtp_process:
            self.embedding = LanguageModelEmbedding(
                config,
                self.padded_vocab_size,
                self.max_sequence_length,
                self.position_embedding_type,
                tp_group=par.tp_group,
            )
        if self.position_embedding_type in ROTARY_EMBEDDINGS:
            self.rotary_pos_emb = RotaryEmbedding(
                config, yarn=self.position_embedding_type == "yarn"
            )
        self.decoder = TransformerBlock(
            config,
            spec,
            pp_rank=par.pp_rank,
            vp_stage=self.vp_stage,
            post_layer_norm=self.final_norm_here,
            tp_group=par.tp_group,
            tp_size=par.tp_size,
            parallel=par,  # MoE layers take their ep/etp groups from the model's grid
        )
        if self.mtp_process:
            self.mtp = MultiTokenPredictionBlock(
                config, spec, tp_group=par.tp_group, tp_size=par.tp_size, parallel=par
            )
        if par.cp_size > 1:
            self._set_cp_group(par.group("cp"))
        if self.post_process:
            self.output_layer = ColumnParallelLinear(
                config.hidden_size,
                self.padded_vocab_size,
                tp_group=par.tp_group,
                bias=False,
                init_method=init_method_normal(config.init_method_std),
                skip_weight_param_allocation=self.has_embedding
                and self.share_embeddings_and_output_weights,
                sequence_parallel=config.sequence_parallel,
                params_dtype=config.params_dtype,
                gradient_accumulation_fusion=config.gradient_accumulation_fusion,
            )
        self._tag_embedding_and_output()

    def _tag_embedding_and_output(self) -> None:
        """Megatron's `is_embedding_or_output_parameter`: the word embedding and the output
        layer's weight (an optimizer may give them their own lr, `decoupled_lr`)."""
        if self.has_embedding:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if self.post_process and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True

    def _set_cp_group(self, group: Any) -> None:
        """Hand the cp group to every core attention (the layer specs do not carry it)."""
        # any module with set_cp_group (duck-typed: a spec may bring its own attention)
        attentions: list[Any] = [m for m in self.decoder.modules() if hasattr(m, "set_cp_group")]
        for module in attentions:
            module.set_cp_group(group)
        if self.mtp_process:  # the MTP block (its rolls) and its layers' attention
            owners: list[Any] = [m for m in self.mtp.modules() if hasattr(m, "set_cp_group")]
            for module in owners:
                module.set_cp_group(group)
        if self.config.cp_comm_type == "a2a+p2p":
            levels = self.parallel.grid.hierarchical_cp_groups if self.parallel.grid else []
            owners = [m for m in self.modules() if hasattr(m, "set_hierarchical_cp_groups")]
            for module in owners:
                module.set_hierarchical_cp_groups(levels)
        if self.decoder.layers and not attentions:
            raise ModelConfigError(
                f"context_parallel_size={self.config.context_parallel_size} but the layer "
                "spec's core attention has no set_cp_group: the rule: only the local "
                "DotProductAttention runs attention over the cp group; fix: use "
                "get_gpt_layer_local_spec() or context_parallel_size=1"
            )

    @property
    def has_embedding(self) -> bool:
        """This chunk holds an embedding: the first stage's, or the MTP stage's copy."""
        return self.pre_process or self.mtp_process

    def _embedding_tables(self) -> list[torch.nn.Parameter]:
        tables = [self.embedding.word_embeddings.weight]
        if self.embedding.add_position_embedding:
            tables.append(self.embedding.position_embeddings.weight)
        return tables

    def _setup_tied_output_weight(self) -> None:
        """Mark the tied copies and make the last stage's copies equal the first stage's.

        Tied on the first and last stage (pp > 1), in this order on both: the embedding
        tables when MTP needs them on the last stage, else the tied output weight."""
        if self.pre_process:
            first = []
            if self.share_embeddings_and_output_weights:
                first.append(self.embedding.word_embeddings.weight)
            if self.config.mtp_num_layers and not self.post_process:
                first = self._embedding_tables()
            for weight in first:
                weight.shared_embedding = True  # type: ignore[attr-defined]
        copies: list[torch.nn.Parameter] = []
        if self.mtp_process and not self.pre_process:
            copies = self._embedding_tables()
        elif (
            self.post_process and not self.pre_process and self.share_embeddings_and_output_weights
        ):
            copies = [self.output_layer.weight]
        if copies and self.parallel.pp_rank == 0:
            raise ModelConfigError(
                "post_process=True, pre_process=False on pipeline rank 0 with tied "
                "embeddings or MTP: the rule: the embedding's copy lives on the last stage; "
                "fix: leave pre_process/post_process as None"
            )
        for weight in copies:
            weight.shared_embedding = weight.shared = True  # type: ignore[attr-defined]
            with torch.no_grad():
                weight.fill_(0.0)
        if self.pre_process != self.post_process or copies:
            group = self.parallel.embedding_group()
            tied = [p for p in self.parameters() if getattr(p, "shared_embedding", False)]
            if group is None and copies and self.parallel.pp_size > 1:
                raise ModelConfigError(
                    f"pipeline rank {self.parallel.pp_rank} holds the standalone MTP stage's "
                    "embedding copy but is not in the grid's embedding group: the rule: the "
                    "copy is kept equal to the first stage's over that group; fix: "
                    f"ParallelConfig(embedding_pp_ranks=(0, {self.parallel.pp_rank}))"
                )
            if group is not None:
                for weight in tied:  # the first stage's values reach the zeroed copies
                    comm.all_reduce(weight.data, group=group)

    # --- pipeline interface --------------------------------------------------------------------
    def set_input_tensor(self, input_tensor: Any) -> None:
        """Input of a chunk that is not the first stage: `[tensor]` `[s, b, h]` (SP: s/t)."""
        if not isinstance(input_tensor, (list, tuple)):
            input_tensor = [input_tensor]
        if len(input_tensor) != 1:
            raise ValueError(f"set_input_tensor takes one tensor, got {len(input_tensor)}")
        self.decoder.set_input_tensor(input_tensor[0])

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        if self.has_embedding:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    @property
    def layer_offset(self) -> int:
        """Global 0-based index of this chunk's first layer (`decoder.layers.{i}` is
        global layer `layer_offset + i`)."""
        return self.decoder.layer_offset

    # --- forward ---------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        loss_mask: torch.Tensor | None = None,
        gather_logits: bool | None = None,
    ) -> torch.Tensor:
        """ids `[b, s]` -> hidden `[s(/t), b, h]` | logits `[b, s, V_pad(/t)]` | loss `[b, s]`.

        `attention_mask`: None (causal) or bool, True = masked out, broadcastable to
        `[b, 1, s, s]`. `gather_logits` (default `not parallel_output`): all-gather the
        logits over tp to `[b, s, V_pad]`.

        With context parallelism every `s` above is this cp rank's `s/cp`: input_ids,
        position_ids (GLOBAL positions) and labels are the rank's shard
        (`context_parallel.get_batch_on_this_cp_rank`), and the loss is `[b, s/cp]`.
        position_ids=None means the global positions of the rank's chunks.

        With MTP, in training with labels, the last stage also needs `input_ids` (and
        `position_ids` for learned positions); `loss_mask` `[b, s(/cp)]` (None: every
        token) weighs the MTP loss, whose grad joins the main loss's in backward.
        """
        # a chunk without layers (a custom layout's empty or embedding-only stage) has no
        # attention to rotate for, so no positions to compute
        uses_rotary = len(self.decoder.layers) > 0 or self.mtp_process
        needs_positions = self.pre_process or uses_rotary
        if self.parallel.cp_size > 1 and position_ids is None and needs_positions:
            position_ids = self._cp_position_ids(input_ids)
        hidden = self.embedding(input_ids, position_ids) if self.pre_process else None
        rotary = None
        if self.position_embedding_type in ROTARY_EMBEDDINGS and uses_rotary:
            s = self._seq_len(input_ids, position_ids)
            rotary = self.rotary_pos_emb(position_ids, s, device=self._device())
        hidden = self.decoder(hidden, attention_mask, rotary)
        if not self.post_process:
            if self.mtp_process and self.training:  # a standalone MTP stage
                outputs = self._mtp_outputs(hidden, input_ids, position_ids, attention_mask, rotary)
                # h_0 and every depth's output to the loss's stage: [(1 + D) s(/t), b, h]
                return torch.cat([hidden, *outputs], dim=0)
            return hidden
        weight = None
        if self.share_embeddings_and_output_weights and self.has_embedding:
            weight = self.embedding.word_embeddings.weight
        self.mtp_report = []
        if self.mtp_standalone and self.training:
            hidden, *outputs = self._split_standalone(hidden)
            if labels is not None:
                hidden = self._attach_mtp_loss(hidden, outputs, labels, loss_mask, weight)
        elif self.mtp_process and labels is not None and self.training:
            outputs = self._mtp_outputs(hidden, input_ids, position_ids, attention_mask, rotary)
            hidden = self._attach_mtp_loss(hidden, outputs, labels, loss_mask, weight)
        logits, _ = self.output_layer(hidden, weight=weight)  # [s, b, V_pad / t]
        if labels is None:
            logits = logits.transpose(0, 1).contiguous()
            gather = (not self.parallel_output) if gather_logits is None else gather_logits
            if gather and self.parallel.tp_size > 1:
                logits = gather_from_tensor_model_parallel_region(logits, self.parallel.tp_group)
            return logits
        # at least fp32 (bf16 / fp16 logits are upcast, as Megatron's; fp64 stays fp64)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = vocab_parallel_cross_entropy(
            logits, labels.transpose(0, 1).contiguous(), self.parallel.tp_group
        )
        return loss.transpose(0, 1).contiguous()

    def _mtp_outputs(self, hidden, input_ids, position_ids, mask, rotary) -> list:
        """Every depth's output `[s(/t), b, h]` from h_0 (mtp.py)."""
        if input_ids is None:
            raise ValueError(
                "GPTModel.forward with mtp_num_layers on the MTP stage (the last pipeline "
                "stage, or a custom layout's MTP stage) got no input_ids: the rule: MTP embeds "
                "the shifted inputs there; fix: pass the micro-batch's tokens (and position "
                "ids) to that stage too"
            )
        if position_ids is None:
            s = input_ids.size(-1)
            position_ids = torch.arange(s, device=input_ids.device)[None].expand_as(input_ids)
        return self.mtp(input_ids, position_ids, hidden, mask, rotary, self.embedding)

    def _split_standalone(self, received: torch.Tensor) -> list[torch.Tensor]:
        """The loss's stage after a standalone MTP stage: h_0 and each depth's output."""
        depths = 1 + (self.config.mtp_num_layers or 0)
        if received.size(0) % depths:
            raise ValueError(
                f"GPTModel on the loss's stage after a standalone MTP stage got {received.size(0)} "
                f"rows, not a multiple of 1 + mtp_num_layers = {depths}: the rule: that stage "
                "sends h_0 and every depth's output; fix: PipelineConfig(variable_seq_lengths="
                "True), so messages may change length"
            )
        return list(received.chunk(depths, dim=0))

    def _attach_mtp_loss(self, hidden, outputs, labels, loss_mask, weight) -> torch.Tensor:
        """h_0 `[s(/t), b, h]` with the MTP loss of every depth attached (mtp.py)."""

        def logits_fn(h: torch.Tensor) -> torch.Tensor:
            logits, _ = self.output_layer(h, weight=weight)
            return logits.to(torch.promote_types(logits.dtype, torch.float32))

        cp_group = self.parallel.group("cp") if self.parallel.cp_size > 1 else None
        hidden, self.mtp_report = mtp_loss(
            hidden,
            outputs,
            labels,
            loss_mask,
            logits_fn,
            self.config,
            tp_group=self.parallel.tp_group,
            cp_group=cp_group,
        )
        return hidden

    def _cp_position_ids(self, input_ids: Any) -> torch.Tensor:
        """`[1, s/cp]`: the global positions of this cp rank's chunks."""
        cp = self.parallel.cp_size
        s = self._seq_len(input_ids, None) * cp
        return cp_positions(s, cp, self.parallel.rank("cp"), device=self._device())[None]

    def _seq_len(self, input_ids: Any, position_ids: Any) -> int:
        if position_ids is not None:
            return position_ids.size(-1)
        if input_ids is not None:
            return input_ids.size(-1)
        t = self.decoder.input_tensor
        if t is None:
            raise ValueError("GPTModel.forward: no input_ids, position_ids or input tensor")
        return t.size(0) * (self.parallel.tp_size if self.config.sequence_parallel else 1)

    def _device(self) -> torch.device:
        param = next(self.parameters(), None)  # (an empty chunk has none: the grid's device)
        return param.device if param is not None else current_device()


def build_model_chunks(
    config: TransformerConfig,
    transformer_layer_spec: Any,
    vocab_size: int,
    max_sequence_length: int,
    grid: ProcessGrid | None = None,
    **kwargs: Any,
) -> list[GPTModel]:
    """This rank's model chunks: one GPTModel per virtual stage (one without vpp)."""
    vpp = config.virtual_pipeline_model_parallel_size
    stages = [None] if vpp is None else list(range(vpp))
    return [
        GPTModel(
            config,
            transformer_layer_spec,
            vocab_size,
            max_sequence_length,
            grid=grid,
            vp_stage=stage,
            **kwargs,
        )
        for stage in stages
    ]
