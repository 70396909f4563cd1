"""Multi-token prediction (DeepSeek-V3 section 2.2; Megatron's `--mtp-num-layers`).

Depth k = 1..D predicts token i + k + 1 at position i. Its input is the previous depth's
output `h_{k-1}` (depth 1: the decoder's output after the final norm) and the embedding of
the inputs shifted k positions left:

    e_k = embedding(roll(ids, -k), roll(pos, -k))                       [s(/t), b, h]
    h_k = final_norm(layer_k(eh_proj(cat[enorm(e_k), hnorm(h_{k-1})])))  [s(/t), b, h]

`eh_proj` is column-parallel (`[2h] -> [h/t]`), its output gathered over tp (and cut to
`[s/t]` under sequence parallelism), as Megatron's. `layer_k` is a transformer layer built
like the last decoder layer (MoE if it is), numbered `num_layers + k`. The embedding and the
output layer are the model's (shared); on the last pipeline stage of a pp > 1 model the
embedding is a copy tied to the first stage's (`GPTModel`).

Loss (`mtp_loss`): labels and loss mask rolled k left (the rolled-in tail is masked out);
the masked mean of each depth's per-token loss, averaged over the depths and weighted by
`mtp_loss_scaling_factor`, is back-propagated through `h_0` with the main loss's grad
scale (`attach_aux_loss`), so it adds to the gradient without changing the reported loss.
Each depth's (sum, count) is kept for logging (`GPTModel.mtp_report`).

Context parallelism: a cp rank holds chunks r and 2cp-1-r of the sequence, so a roll moves
each chunk's first element to the end of the chunk before it (`roll_left`, one small
all-gather over cp); counts are all-reduced over cp and each rank attaches its share (its
tokens' loss sum over the whole sequence's count): the shares add up over cp to the
sequence's loss, as the MoE aux losses' do. A trainer whose grad reduction averages over
cp scales the aux-loss grad by cp (the app does, as Megatron scales the MoE aux loss).
"""

from __future__ import annotations

from typing import Any

import torch

from pentatron.parallel_state import comm
from pentatron.tp_layers import (
    ColumnParallelLinear,
    checkpoint,
    gather_from_tensor_model_parallel_region,
    init_method_normal,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)

from .config import TransformerConfig
from .moe.load_balancing import attach_aux_loss
from .norm import Norm
from .spec import build_module
from .transformer_block import sp_dropout_rng_context


def _cp_size(cp_group: Any) -> int:
    if cp_group is None or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(cp_group)


def roll_left(t: torch.Tensor, cp_group: Any = None) -> torch.Tensor:
    """`[b, s]` (cp: this rank's `[b, s/cp]`) shifted one position left along the last dim;
    the last position of the whole sequence becomes 0 (Megatron's `roll_tensor(-1)`)."""
    cp = _cp_size(cp_group)
    if cp == 1:
        out = torch.roll(t, shifts=-1, dims=-1)
        out[..., -1] = 0
        return out
    halves = list(t.chunk(2, dim=-1))  # chunks r and 2cp-1-r of the sequence
    firsts = torch.stack([h[..., 0] for h in halves]).contiguous()  # [2, b]
    every = firsts.new_empty((cp * 2, *firsts.shape[1:]))
    comm.all_gather_into_tensor(every, firsts, group=cp_group)
    every = every.view(cp, 2, *firsts.shape[1:])
    r = torch.distributed.get_rank(cp_group)
    # chunk j's first element: rank j's first half (j < cp), else rank 2cp-1-j's second
    after_first = every[r + 1, 0] if r + 1 < cp else every[cp - 1, 1]  # chunk r + 1
    after_second = every[r - 1, 1] if r > 0 else torch.zeros_like(every[0, 0])  # 2cp - r
    parts: list[torch.Tensor] = []
    for half, nxt in zip(halves, (after_first, after_second)):
        rolled = torch.roll(half, shifts=-1, dims=-1)
        rolled[..., -1] = nxt
        parts.append(rolled)
    return torch.cat(parts, dim=-1)


class MultiTokenPredictionLayer(torch.nn.Module):
    """One depth: `forward(h_prev, e_k, mask, rotary)` `[s(/t), b, h]` x2 -> `[s(/t), b, h]`."""

    def __init__(
        self,
        config: TransformerConfig,
        spec: Any,
        depth: int,
        *,
        tp_group: Any = None,
        tp_size: int = 1,
        parallel: Any = None,
    ) -> None:
        super().__init__()
        self.config, self.depth, self.tp_group = config, depth, tp_group
        h = config.hidden_size
        self.enorm = Norm(config, h)
        self.hnorm = Norm(config, h)
        self.eh_proj = ColumnParallelLinear(
            2 * h,
            h,
            tp_group=tp_group,
            bias=False,
            init_method=init_method_normal(config.init_method_std),
            sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype,
            gradient_accumulation_fusion=config.gradient_accumulation_fusion,
        )
        extra = {"parallel": parallel} if parallel is not None else {}
        self.mtp_model_layer = build_module(
            spec,
            config,
            layer_number=config.num_layers + depth,
            tp_group=tp_group,
            tp_size=tp_size,
            **extra,
        )
        self.final_layernorm = Norm(config, h)

    def forward(self, hidden, decoder_input, mask, rotary) -> torch.Tensor:
        if self.config.recompute_granularity == "full" and self.training:
            cos, sin = rotary if rotary is not None else (None, None)
            return checkpoint(self._forward, hidden, decoder_input, mask, cos, sin)
        return self._forward(hidden, decoder_input, mask, *(rotary or (None, None)))

    def _forward(self, hidden, decoder_input, mask, cos, sin) -> torch.Tensor:
        # embedding first, then the hidden state (Megatron's and DeepSeek's eh_proj order)
        x = torch.cat([self.enorm(decoder_input), self.hnorm(hidden)], dim=-1)
        x, _ = self.eh_proj(x)  # [s, b, h/t] (sequence parallel: gathered along s)
        x = gather_from_tensor_model_parallel_region(x, self.tp_group)  # [s, b, h]
        if self.config.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)  # [s/t, b, h]
        x = self.mtp_model_layer(x, mask, None if cos is None else (cos, sin))
        return self.final_layernorm(x)


class MultiTokenPredictionBlock(torch.nn.Module):
    """The D depths: `forward(ids, pos, h_0, mask, rotary, embedding)` -> `[h_1 .. h_D]`."""

    def __init__(
        self,
        config: TransformerConfig,
        spec: Any,
        *,
        tp_group: Any = None,
        tp_size: int = 1,
        parallel: Any = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.cp_group: Any = None
        assert config.mtp_num_layers, "built only with mtp_num_layers"
        self.layers = torch.nn.ModuleList(
            MultiTokenPredictionLayer(
                config, spec, depth, tp_group=tp_group, tp_size=tp_size, parallel=parallel
            )
            for depth in range(1, config.mtp_num_layers + 1)
        )

    def set_cp_group(self, group: Any) -> None:
        self.cp_group = group  # rolls exchange chunk boundaries over it

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        hidden: torch.Tensor,
        mask: Any,
        rotary: Any,
        embedding: Any,
    ) -> list[torch.Tensor]:
        """ids, pos `[b, s(/cp)]`; `hidden` = h_0 `[s(/t), b, h]` -> each depth's output."""
        outputs = []
        with sp_dropout_rng_context(self.config, self.training):
            for layer in self.layers:
                input_ids = roll_left(input_ids, self.cp_group)
                position_ids = roll_left(position_ids, self.cp_group)
                hidden = layer(hidden, embedding(input_ids, position_ids), mask, rotary)
                outputs.append(hidden)
        return outputs


def mtp_loss(
    hidden: torch.Tensor,
    depth_outputs: list[torch.Tensor],
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None,
    logits_fn: Any,
    config: TransformerConfig,
    *,
    tp_group: Any = None,
    cp_group: Any = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(`hidden` with the MTP loss attached, each depth's detached `[sum, count]`).

    `hidden` `[s(/t), b, h]` is h_0 (what the main output layer reads); `labels`,
    `loss_mask` `[b, s(/cp)]`; `logits_fn(h)` -> fp32 logits `[s, b, V_pad/t]`. The attached
    term is weight / D * sum_k (sum of masked losses_k) / count_k, counts over the whole
    sequence (a cp rank's term is its share) and, with `calculate_per_token_loss`, times the
    micro-batch's unrolled count (the step divides every grad by the total token count).
    """
    mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask
    mask = mask.float()
    tokens = _summed_over(mask.sum(), cp_group)  # the unrolled count (per-token mode)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    report = []
    for h in depth_outputs:
        labels, mask = roll_left(labels, cp_group), roll_left(mask, cp_group)
        losses = vocab_parallel_cross_entropy(logits_fn(h), labels.t().contiguous(), tp_group)
        loss_sum = (losses.t() * mask).sum()  # [s, b] -> [b, s], masked
        pair = torch.stack([loss_sum.detach().clone(), mask.sum()]).to(torch.float32)
        pair = _summed_over(pair, cp_group)
        report.append(pair)
        count = pair[1].clamp(min=1.0)
        term = loss_sum / count
        if config.calculate_per_token_loss:
            term = term * tokens
        total = total + term
    weight = config.mtp_loss_scaling_factor / len(depth_outputs)
    return attach_aux_loss(hidden, total * weight), report


def _summed_over(t: torch.Tensor, group: Any) -> torch.Tensor:
    if _cp_size(group) > 1:
        t = t.clone()
        comm.all_reduce(t, group=group)
    return t
