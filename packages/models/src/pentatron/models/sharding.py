"""How each GPT parameter is split over tensor parallelism, in one place.

Names are Megatron's local-spec state-dict names. With t tp ranks, rank r holds:

| parameter (suffix)                           | split              | rank r's part            |
|----------------------------------------------|--------------------|--------------------------|
| embedding.word_embeddings.weight [V_pad, h]  | dim 0 (vocab)      | rows r V_pad/t ...       |
| output_layer.weight [V_pad, h]               | dim 0 (vocab)      | same rows                |
| self_attention.linear_qkv.weight/.bias       | dim 0, contiguous  | query groups r ng/t ...  |
| mlp.linear_fc1.weight/.bias (gelu)           | dim 0, contiguous  | rows r ffn/t ...         |
| mlp.linear_fc1.weight/.bias (swiglu)         | dim 0, stride 2    | cat([gate_r, up_r])      |
| self_attention.linear_proj.weight [h, nq d]  | dim 1              | columns r nq d/t ...     |
| self_attention.core_attention.softmax_offset [nq] | dim 0         | heads r nq/t ...         |
| MLA: linear_q_proj, linear_{q,kv}_up_proj .weight | dim 0, contiguous | rows r out/t ... |
| MLA: linear_{q,kv}_down_proj.weight          | replicated         | the full tensor          |
| mlp.linear_fc2.weight [h, ffn]               | dim 1              | columns r ffn/t ...      |
| MTP: mtp.layers.{k}.eh_proj.weight [h, 2h]   | dim 0, contiguous  | rows r h/t ...           |
| norms, position embeddings, row biases       | replicated         | the full tensor          |
| mlp.router.weight / .bias / .expert_bias     | replicated         | the full tensor          |
| mlp.shared_experts.gate_weight               | replicated         | the full tensor          |
| mlp.experts.linear_fc1.weight [E, F1, h]     | ep dim 0, etp dim 1 (stride 2 swiglu) |  |
| mlp.experts.linear_fc1.bias [E, F1]          | ep dim 0, etp dim 1 (stride 2 swiglu) |  |
| mlp.experts.linear_fc2.weight [E, h, ffn]    | ep dim 0, etp dim 2|                          |
| mlp.experts.linear_fc2.bias [E, h]           | ep dim 0           |                          |

Expert tensors are split over the expert grid: `ep_rank` takes experts ep_rank*E/ep ...,
then `etp_rank` its etp shard (`shard_full_tensor(..., ep_rank=, ep_size=, etp_rank=,
etp_size=)`; `merge_shards(..., ep_size=)` takes expert shards ep-major, etp-minor).

The vocabulary is padded to `padded_vocab_size` (a multiple of
make_vocab_size_divisible_by * t) before splitting; `shard_full_tensor` pads an unpadded
`[V, h]` table with zero rows and `merge_shards(vocab_size=V)` drops them again.

Layer indices: a chunk's state dict uses local indices (`decoder.layers.{i}`); global
layer = `model.layer_offset + i` (`global_param_name` / `local_param_name`). With tied
embeddings and pp > 1 the last stage holds `output_layer.weight`, a copy of
`embedding.word_embeddings.weight` (shard it like that one); with one stage it is absent.
MTP layers (`mtp.layers.{k}.`, all on the last stage) keep their names; their inner
`mtp_model_layer.` follows the decoder layer's rules. With MTP and pp > 1 the last stage
holds a copy of the embedding under the same names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from pentatron.tp_layers import shard_of

from .config import TransformerConfig

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_VOCAB = re.compile(r"(^|\.)(word_embeddings|output_layer)\.weight$")
_COLUMN = re.compile(
    r"\.(linear_qkv|linear_fc1|linear_q_proj|linear_q_up_proj|linear_kv_up_proj|eh_proj)"
    r"\.(weight|bias)$"
)
_ROW = re.compile(r"\.(linear_proj|linear_fc2)\.weight$")
_HEADS = re.compile(r"\.core_attention\.softmax_offset$")  # learnable sinks, one per head
_REPLICATED = re.compile(
    r"(layernorm\.(weight|bias)|layer_norm_(weight|bias)|position_embeddings\.weight|(linear_proj|linear_fc2)\.bias"
    r"|router\.(weight|bias|expert_bias|local_tokens_per_expert)|shared_experts\.gate_weight"
    r"|(enorm|hnorm)\.(weight|bias)|(linear_q_down_proj|linear_kv_down_proj)\.weight)$"
)
# A layer's separate norm (local spec) -> the same norm fused into the next linear (TE spec).
FUSED_NORMS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
_FUSED_TO_LOCAL = {fused: local for local, fused in FUSED_NORMS.items()}
_FUSED_NORM = re.compile(
    r"^(decoder\.layers\.\d+\.|mtp\.layers\.\d+\.mtp_model_layer\.)("
    + "|".join(re.escape(f) for f in _FUSED_TO_LOCAL)
    + r")(?=(weight|bias)$)"
)
_EXPERT = re.compile(r"\.experts\.(linear_fc1|linear_fc2)\.(weight|bias)$")


@dataclass(frozen=True)
class ParamSharding:
    """`dim`: the split dim (None: replicated); `stride`: fused blocks; `vocab`: padded rows."""

    dim: int | None
    stride: int = 1
    vocab: bool = False
    expert: bool = False  # split over ep on dim 0, `dim` is then the etp split


def _expert_sharding(m: re.Match, config: TransformerConfig) -> ParamSharding:
    linear, kind = m.group(1), m.group(2)
    if linear == "linear_fc1":
        return ParamSharding(1, 2 if config.gated_linear_unit else 1, expert=True)
    return ParamSharding(2 if kind == "weight" else None, expert=True)


def param_sharding(name: str, config: TransformerConfig) -> ParamSharding:
    """The tp split of parameter `name` (local or global name; see the module table)."""
    if _VOCAB.search(name):
        return ParamSharding(0, 1, vocab=True)
    expert = _EXPERT.search(name)
    if expert:
        return _expert_sharding(expert, config)
    column = _COLUMN.search(name)
    if column:
        gated = column.group(1) == "linear_fc1" and config.gated_linear_unit
        return ParamSharding(0, 2 if gated else 1)
    if _ROW.search(name):
        return ParamSharding(1)
    if _HEADS.search(name):
        return ParamSharding(0)
    if _REPLICATED.search(name):
        return ParamSharding(None)
    raise KeyError(
        f"{name!r} is not a GPT parameter name this helper knows; the rule: Megatron "
        "local-spec names (see pentatron.models.sharding); fix: check the name"
    )


def _pad_rows(full: torch.Tensor, rows: int | None) -> torch.Tensor:
    if rows is None or full.size(0) == rows:
        return full
    if full.size(0) > rows:
        raise ValueError(f"vocabulary of {full.size(0)} rows exceeds padded_vocab_size={rows}")
    pad = full.new_zeros((rows - full.size(0), *full.shape[1:]))
    return torch.cat([full, pad], dim=0)


def shard_full_tensor(
    name: str,
    full: torch.Tensor,
    tp_rank: int,
    tp_size: int,
    *,
    config: TransformerConfig,
    padded_vocab_size: int | None = None,
    ep_rank: int = 0,
    ep_size: int = 1,
    etp_rank: int | None = None,
    etp_size: int | None = None,
) -> torch.Tensor:
    """Tp rank `tp_rank`'s part of the full (tp=1) tensor `full` of parameter `name`.

    Expert tensors: the experts of `ep_rank`, then the `etp_rank` shard (default: tp's).
    """
    rule = param_sharding(name, config)
    if rule.expert:
        local = full.size(0) // ep_size
        full = full[ep_rank * local : (ep_rank + 1) * local]
        tp_rank = tp_rank if etp_rank is None else etp_rank
        tp_size = tp_size if etp_size is None else etp_size
    if rule.vocab:
        full = _pad_rows(full, padded_vocab_size)
    if rule.dim is None or tp_size == 1:
        return full.clone()
    return shard_of(full, rule.dim, tp_rank, tp_size, rule.stride).clone()


def merge_shards(
    name: str,
    shards: list[torch.Tensor],
    *,
    config: TransformerConfig,
    vocab_size: int | None = None,
    ep_size: int = 1,
) -> torch.Tensor:
    """The full tensor from the shards of tp ranks 0..t-1 (inverse of `shard_full_tensor`).

    `vocab_size` drops the padding rows of vocabulary tensors. Expert tensors take the
    shards of (ep rank, etp rank) in ep-major order: `shards[ep_rank * etp + etp_rank]`.
    """
    rule = param_sharding(name, config)
    if rule.expert:
        if len(shards) % ep_size:
            raise ValueError(
                f"{name}: {len(shards)} shards for ep_size={ep_size}; the rule: ep * etp "
                "shards, ep-major; fix: pass every (ep, etp) rank's shard"
            )
        etp = len(shards) // ep_size
        tp_rule = ParamSharding(rule.dim, rule.stride)
        parts = [_merge_tp(tp_rule, shards[r * etp : (r + 1) * etp]) for r in range(ep_size)]
        return torch.cat(parts, dim=0)
    full = _merge_tp(rule, shards)
    if rule.vocab and vocab_size is not None:
        full = full[:vocab_size]
    return full


def _merge_tp(rule: ParamSharding, shards: list[torch.Tensor]) -> torch.Tensor:
    if rule.dim is None or len(shards) == 1:
        full = shards[0].clone()
    else:
        blocks = [torch.chunk(s, rule.stride, dim=rule.dim) for s in shards]
        full = torch.cat(
            [blocks[r][b] for b in range(rule.stride) for r in range(len(shards))], dim=rule.dim
        )
    return full


def global_param_name(name: str, layer_offset: int) -> str:
    """`decoder.layers.{i}.x` of a chunk -> `decoder.layers.{layer_offset + i}.x`, in the
    local spec's names: a norm fused into the next linear (the TE spec's
    `self_attention.linear_qkv.layer_norm_weight`, `mlp.linear_fc1.layer_norm_bias`) is
    named as the separate norm it replaces (`input_layernorm.weight`,
    `pre_mlp_layernorm.bias`), so both specs share checkpoints and conversions."""
    name = _FUSED_NORM.sub(lambda m: f"{m.group(1)}{_FUSED_TO_LOCAL[m.group(2)]}", name)
    return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)


def local_param_name(name: str, layer_offset: int) -> str:
    """Inverse of `global_param_name`'s layer index (the caller knows the layer is in this
    chunk); the name stays in the local spec's layout."""
    return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) - layer_offset}.", name)


def state_tensors(model: torch.nn.Module, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """`model.state_dict()` without modules' extra state (transformer-engine's FP8 metadata,
    `*._extra_state`): the parameters and buffers that checkpoints and conversions carry."""
    return {
        k: v
        for k, v in model.state_dict(keep_vars=keep_vars).items()
        if not k.endswith("_extra_state")
    }


def full_tensor_for(model: Any, local_name: str, full_state_dict: dict) -> torch.Tensor:
    """The full tensor of one local parameter of `model` in a global full state dict."""
    name = global_param_name(local_name, model.layer_offset)
    if name not in full_state_dict and name == "output_layer.weight":
        name = "embedding.word_embeddings.weight"  # tied: the last stage's copy
    if name not in full_state_dict:
        raise KeyError(f"full state dict has no {name!r} (for {local_name!r} of this chunk)")
    return full_state_dict[name]


@torch.no_grad()
def load_full_state_dict(model: Any, full_state_dict: dict[str, torch.Tensor]) -> None:
    """Copy this chunk's tp shards out of a full (tp=1, global names) state dict.

    Vocabulary tensors may be unpadded `[V, h]` (zero rows are added). Every parameter of
    `model` must be found; extra entries (other chunks' layers) are ignored.
    """
    par = model.parallel
    for local, param in state_tensors(model, keep_vars=True).items():
        full = full_tensor_for(model, local, full_state_dict)
        part = shard_full_tensor(
            local,
            full,
            par.tp_rank,
            par.tp_size,
            config=model.config,
            padded_vocab_size=model.padded_vocab_size,
            ep_rank=par.rank("ep"),
            ep_size=par.ep_size,
            etp_rank=par.rank("etp"),
            etp_size=par.etp_size,
        )
        if part.shape != param.shape:
            raise ValueError(
                f"{local}: shard of the full tensor has shape {tuple(part.shape)}, the model's "
                f"parameter {tuple(param.shape)}; fix: check the config against the checkpoint"
            )
        param.copy_(part)
