"""Layout-independent initialisation: every tp / pp / vpp layout starts from the same model.

Megatron seeds each pipeline stage differently, so the same seed gives different weights
at pp=1 and pp=2, and runs at two layouts cannot be compared. Here each random parameter
is drawn as its full (tp=1) tensor from a generator seeded by (seed, global parameter
name), then cut to this rank's tp shard (experts: its ep experts and etp shard): the weights depend on the seed and the model only.
The cost is one full tensor per parameter at start-up (as Megatron's
--use-cpu-initialization). Norm weights and biases keep their constant init; the random
vectors, gpt-oss's learnable softmax sinks (`[nq]`, split by heads) and the MoE router's
logit bias, are re-drawn too.
"""

from __future__ import annotations

import math
import zlib

import torch

from pentatron.models import TransformerConfig
from pentatron.models.sharding import global_param_name, param_sharding, shard_full_tensor

_TIED = "embedding.word_embeddings.weight"
_SCALED = (".linear_proj.weight", ".linear_fc2.weight")
# 1-D yet drawn by the init method (Megatron's): gpt-oss's sinks, the MoE router's bias
_RANDOM_VECTORS = (".core_attention.softmax_offset", ".router.bias")


def _std(name: str, config: TransformerConfig) -> float:
    if config.scaled_output_init and name.endswith(_SCALED):
        return config.init_method_std / math.sqrt(2.0 * config.num_layers)
    return config.init_method_std


def _full_shape(name: str, local: torch.Size, model) -> list[int]:
    rule, par = param_sharding(name, model.config), model.parallel
    shape = list(local)
    if rule.vocab:
        shape[0] = model.vocab_size  # padding rows are zeros (added by shard_full_tensor)
    elif rule.expert:  # [E/ep, ...] split over etp on rule.dim
        shape[0] *= par.ep_size
        if rule.dim is not None:
            shape[rule.dim] *= par.etp_size
    elif rule.dim is not None:
        shape[rule.dim] *= par.tp_size
    return shape


@torch.no_grad()
def init_weights_layout_independent(model, seed: int) -> None:
    """Re-draw every matrix of GPTModel chunk `model` (see the module docstring)."""
    par, config = model.parallel, model.config
    for local, param in model.named_parameters():
        name = global_param_name(local, model.layer_offset)
        if param.dim() < 2 and not name.endswith(_RANDOM_VECTORS):
            continue
        key = (
            _TIED
            if name == "output_layer.weight" and model.share_embeddings_and_output_weights
            else name
        )
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        shape = _full_shape(name, param.shape, model)
        full = torch.randn(shape, generator=gen, dtype=torch.float32) * _std(key, config)
        part = shard_full_tensor(
            name,
            full,
            par.tp_rank,
            par.tp_size,
            config=config,
            padded_vocab_size=model.padded_vocab_size,
            ep_rank=par.rank("ep"),
            ep_size=par.ep_size,
            etp_rank=par.rank("etp"),
            etp_size=par.etp_size,
        )
        param.copy_(part.to(param.dtype))
