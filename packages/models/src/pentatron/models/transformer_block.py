"""`TransformerBlock`: the layers of one pipeline chunk, then (last stage) the final norm.

Which layers a chunk holds comes from `config.stage_layout()` (pentatron.pipeline's
StageLayout: virtual stage c * p + r holds the c-th chunk of rank r, Megatron's
round-robin). `get_layer_offset` / `get_num_layers_to_build` are the one place that maps
(pp rank, vp stage) to layers. Local layer i of a chunk is global layer `layer_offset + i`
(0-based; its `layer_number` is `layer_offset + i + 1`).

Activation recomputation (training only), through tp_layers.checkpoint so dropout replays:
- full/uniform: the chunk's layers in groups of `recompute_num_layers`, each group one
  checkpoint;
- full/block: the first `recompute_num_layers` layers of the chunk, one checkpoint each;
- selective: the parts `recompute_modules` names (Megatron's default ["core_attn"]; see
  recompute.py for each name and where it is done).
With sequence parallelism the layers run inside the tracker's model-parallel RNG fork, so
dropout on the `[s/t, b, h]` shards differs across tp ranks (Megatron-LM).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from pentatron.tp_layers import checkpoint, get_rng_tracker

from .config import TransformerConfig
from .norm import Norm
from .parallel import ModelParallel
from .spec import build_module


def get_num_layers_to_build(
    config: TransformerConfig, pp_rank: int = 0, vp_stage: int | None = None
) -> int:
    """Transformer layers of the chunk `vp_stage` (None: 0) of pipeline rank `pp_rank`."""
    return config.stage_layout().num_layers_to_build(pp_rank, vp_stage or 0)


def get_layer_offset(
    config: TransformerConfig, pp_rank: int = 0, vp_stage: int | None = None
) -> int:
    """Global 0-based index of the first layer of that chunk."""
    return config.stage_layout().layer_offset(pp_rank, vp_stage or 0)


def sp_dropout_rng_context(config: TransformerConfig, training: bool) -> Any:
    """The tracker's model-parallel fork under SP when dropout can draw (Megatron): the
    `[s/t, b, h]` shards draw different masks on each tp rank."""
    dropout = training and (config.hidden_dropout > 0 or config.attention_dropout > 0)
    if config.sequence_parallel and dropout:
        return get_rng_tracker().fork()
    return contextlib.nullcontext()


class TransformerBlock(torch.nn.Module):
    """`forward(hidden, attention_mask, rotary)`: `[s, b, h]` (SP `[s/t, b, h]`) -> same.

    On a chunk that is not the first stage `hidden` is None and the input comes from
    `set_input_tensor` (the pipeline schedule's p2p receive).
    """

    def __init__(
        self,
        config: TransformerConfig,
        spec: Any,
        *,
        pp_rank: int = 0,
        vp_stage: int | None = None,
        post_layer_norm: bool = True,
        tp_group: Any = None,
        tp_size: int = 1,
        parallel: ModelParallel | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        if parallel is None and config.is_moe:
            # MoE layers need the expert groups; without a ModelParallel take the default grid.
            parallel = ModelParallel.resolve(config, None, vp_stage)
        # MoE layers take their ep/etp groups from it, FP8 layers the amax-reduction group
        extra = {"parallel": parallel} if parallel is not None else {}
        self.layer_offset = get_layer_offset(config, pp_rank, vp_stage)
        n = get_num_layers_to_build(config, pp_rank, vp_stage)
        self.layers = torch.nn.ModuleList(
            build_module(
                spec,
                config,
                layer_number=self.layer_offset + i + 1,
                tp_group=tp_group,
                tp_size=tp_size,
                **extra,
            )
            for i in range(n)
        )
        self.final_layernorm = Norm(config, config.hidden_size) if post_layer_norm else None
        self.input_tensor: torch.Tensor | None = None
        self.cuda_graphs: Any = None  # a LayerCudaGraphs attaches itself (enable_cuda_graph)
        self.cuda_graph_chunk = 0

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.input_tensor = tensor

    def forward(
        self, hidden: torch.Tensor | None, attention_mask: Any = None, rotary: Any = None
    ) -> torch.Tensor:
        if hidden is None:
            hidden = self.input_tensor
        if hidden is None:
            raise ValueError(
                "TransformerBlock got no input: the first stage passes embeddings, later "
                "stages need set_input_tensor([tensor]) (the pipeline schedule calls it)"
            )
        cos, sin = rotary if rotary is not None else (None, None)
        with self._rng_context():
            if self.config.recompute_granularity == "full" and self.training:
                hidden = self._checkpointed_forward(hidden, attention_mask, cos, sin)
            else:
                hidden = self._run(0, len(self.layers), hidden, attention_mask, cos, sin)
        if self.final_layernorm is not None:
            hidden = self.final_layernorm(hidden)
        if not self.layers and self.final_layernorm is None:
            hidden = hidden.clone()  # a chunk's output must own its storage (pseudo-freeing)
        return hidden

    def _rng_context(self) -> Any:
        return sp_dropout_rng_context(self.config, self.training)

    def _run(self, start: int, end: int, hidden, mask, cos, sin) -> torch.Tensor:
        rotary = None if cos is None else (cos, sin)
        for i in range(start, end):
            if self.cuda_graphs is not None:
                hidden = self.cuda_graphs(self, i, hidden, mask, rotary)
            else:
                hidden = self.layers[i](hidden, mask, rotary)
        return hidden

    def _checkpointed_forward(self, hidden, mask, cos, sin) -> torch.Tensor:
        n, k = len(self.layers), self.config.recompute_num_layers
        assert k is not None, "recompute_granularity='full' requires recompute_num_layers"
        if self.config.recompute_method == "uniform":
            for start in range(0, n, k):
                end = min(start + k, n)
                hidden = checkpoint(self._segment(start, end), hidden, mask, cos, sin)
            return hidden
        for i in range(n):  # block: the first k layers of this chunk
            if i < k:
                hidden = checkpoint(self._segment(i, i + 1), hidden, mask, cos, sin)
            else:
                hidden = self._run(i, i + 1, hidden, mask, cos, sin)
        return hidden

    def _segment(self, start: int, end: int) -> Any:
        def run(hidden, mask, cos, sin):
            return self._run(start, end, hidden, mask, cos, sin)

        return run
