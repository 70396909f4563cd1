"""Self-attention: fused QKV (column-parallel) -> RoPE -> causal SDPA -> output (row-parallel).

The QKV weight is laid out per query group, as Megatron-LM: for each group g, its
nq/ng query heads, then k_g, then v_g (`[(nq + 2 ng) d, h]`). A contiguous 1/t of the rows
is therefore ng/t whole groups, so tensor parallelism splits heads and groups together.

    [s, b, h] (SP: [s/t, b, h]) -> linear_qkv (SP: all-gather(tp)) -> [s, b, (nq+2ng) d / t]
      -> q [s, b, nq/t, d], k, v [s, b, ng/t, d] -> q/k norm -> RoPE
      -> core attention (SDPA on grouped k/v; repeated to nq/t heads only with a mask or
         heads over 256 dims, see sdpa.py) -> [s, b, nq d / t]
      -> linear_proj (all-reduce(tp); SP: reduce-scatter(tp)) -> [s, b, h] (SP: [s/t, b, h])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pentatron.parallel_state import current_device
from pentatron.tp_layers import (
    checkpoint,
    divide,
    get_rng_tracker,
    init_method_normal,
    init_sharded_,
    set_tensor_model_parallel_attributes,
)

from .attention_variants import variant_sdpa
from .config import ModelConfigError, TransformerConfig
from .context_parallel.attention import check_cp_inputs, context_parallel_attention
from .recompute import recompute_now
from .rope import apply_rotary_pos_emb
from .spec import build_linear, build_module


def sink_shard_rank(tp_group: Any) -> int:
    """Which 1/t of the heads' sinks this rank holds: its rank in the tp group."""
    return torch.distributed.get_rank(tp_group)


@dataclass
class SelfAttentionSubmodules:
    linear_qkv: Any = None
    core_attention: Any = None
    linear_proj: Any = None
    q_layernorm: Any = None
    k_layernorm: Any = None


class DotProductAttention(torch.nn.Module):
    """Causal scaled-dot-product attention over this rank's heads (torch SDPA).

    q `[s, b, nq/t, d]`, k/v `[s, b, ng/t, d]` -> `[s, b, nq d / t]`. `attention_mask`
    (optional, Megatron's convention): bool, True = masked out, broadcastable to
    `[b, 1, s, s]`; None means causal. Attention dropout draws from the tracker's
    model-parallel RNG (each rank's heads differ); under sequence parallelism the whole
    block already runs inside that fork (see TransformerBlock).

    With `config.context_parallel_size > 1` q/k/v hold this cp rank's load-balanced chunks
    (`[s/cp, b, ., d]`) and attention runs over `cp_group` by `config.cp_comm_type`
    (see `context_parallel`); GPTModel hands the group in with `set_cp_group`.

    gpt-oss's variants (attention_variants.py): `config.window_size` on the layers
    `config.is_window_attention_layer` picks, and with `config.softmax_type` other than
    "vanilla" a sink logit per head, `softmax_offset` `[nq/t]` (a parameter for
    "learnable": this rank's heads of one master vector drawn by `init_method`, so every
    tp layout starts from the same numbers; needs `tp_group` when tp > 1).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        tp_size: int,
        cp_group: Any = None,
        softmax_scale: float | None = None,
        tp_group: Any = None,
        init_method: Any = None,
    ) -> None:
        super().__init__()
        self.config, self.layer_number = config, layer_number
        self.cp_group = cp_group
        self.hierarchical_cp_groups: list[Any] | None = None  # "a2a+p2p": [a2a, ring]
        d, groups = config.kv_channels, config.num_query_groups
        assert d is not None and groups is not None, "TransformerConfig.__post_init__ fills them"
        self.groups_per_rank = divide(groups, tp_size, "num_query_groups")
        # default 1/sqrt(head dim); MLA passes 1/sqrt(d_qk + d_pe) (its q/k dims)
        self.scale = 1.0 / (d**0.5) if softmax_scale is None else softmax_scale
        window = config.window_size
        self.window: int | None = None
        if window is not None and config.is_window_attention_layer(layer_number):
            self.window = window[0]
        heads = divide(config.num_attention_heads, tp_size, "num_attention_heads")
        self.softmax_offset: torch.Tensor | None
        if config.softmax_type == "off-by-one":
            zeros = torch.zeros(heads, dtype=config.params_dtype, device=current_device())
            self.register_buffer("softmax_offset", zeros, persistent=False)
        elif config.softmax_type == "learnable":
            self.softmax_offset = self._learnable_sinks(heads, tp_size, tp_group, init_method)
        else:
            self.softmax_offset = None

    def _learnable_sinks(
        self, heads: int, tp_size: int, tp_group: Any, init_method: Any
    ) -> torch.nn.Parameter:
        if tp_size > 1 and tp_group is None:
            raise ModelConfigError(
                f"softmax_type='learnable' at tensor_model_parallel_size={tp_size} without "
                "tp_group: the rule: each tp rank holds its heads' sinks of one master vector; "
                "fix: build the attention through SelfAttention (it passes tp_group)"
            )
        init = init_method or init_method_normal(self.config.init_method_std)
        sinks = torch.empty(heads, dtype=self.config.params_dtype, device=current_device())
        rank = sink_shard_rank(tp_group) if tp_size > 1 else 0
        init_sharded_(sinks, (heads * tp_size,), init, 0, rank, tp_size)
        param = torch.nn.Parameter(sinks)
        set_tensor_model_parallel_attributes(param, tp_size > 1, 0, 1)
        return param

    def set_cp_group(self, group: Any) -> None:
        """The process group of the cp ranks (used when context_parallel_size > 1)."""
        self.cp_group = group

    def set_hierarchical_cp_groups(self, groups: list[Any]) -> None:
        """cp_comm_type="a2a+p2p"'s [all-to-all group, ring group] (the grid's
        `hierarchical_cp_groups`)."""
        self.hierarchical_cp_groups = list(groups)

    def _cp_groups(self) -> Any:
        if self.config.cp_comm_type == "a2a+p2p" and self.cp_group is not None:
            return self.hierarchical_cp_groups
        return self.cp_group

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: Any = None
    ) -> torch.Tensor:
        s, b = q.shape[:2]
        if self.config.context_parallel_size > 1:
            p = self.config.attention_dropout if self.training else 0.0
            group = self._cp_groups()
            check_cp_inputs(self.config, group, s, attention_mask, p)
            d_v = v.size(-1)
            if d_v != k.size(-1):
                # MLA: v's head dim (d_v) differs from q/k's (d_qk + d_pe); the cp kernels
                # move K and V as one block, so V travels zero-padded to k's dim, and the
                # padded output columns (attention-weighted zeros) are dropped.
                v = torch.nn.functional.pad(v, (0, k.size(-1) - d_v))
                out = context_parallel_attention(q, k, v, self.scale, self.config, group)
                return out.view(s, b, -1, k.size(-1))[..., :d_v].reshape(s, b, -1)
            return context_parallel_attention(
                q,
                k,
                v,
                self.scale,
                self.config,
                group,
                sinks=self.softmax_offset,
                window=self.window,
            )
        q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))  # [b, n, s, d]
        p = self.config.attention_dropout if self.training else 0.0
        mask = None if attention_mask is None else ~attention_mask
        with self._dropout_rng(p):
            out = variant_sdpa(  # plain causal SDPA without sinks or a window
                q,
                k,
                v,
                sinks=self.softmax_offset,
                window=self.window,
                keep=mask,
                dropout_p=p,
                scale=self.scale,
                attention_backend=self.config.attention_backend,
            )
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _dropout_rng(self, p: float) -> Any:
        import contextlib

        if p == 0.0 or self.config.sequence_parallel:
            return contextlib.nullcontext()
        return get_rng_tracker().fork()


class SelfAttention(torch.nn.Module):
    """Megatron's SelfAttention: `forward(x, attention_mask, rotary)` -> `(out, bias)`.

    `linear_proj` skips its bias add so the layer fuses it into bias-dropout-add.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        tp_group: Any = None,
        tp_size: int = 1,
        init_method: Any = None,
        output_layer_init_method: Any = None,
    ) -> None:
        super().__init__()
        if config.multi_latent_attention:
            raise ModelConfigError(
                "SelfAttention with multi_latent_attention=True: the rule: MLA layers come "
                "from the MLA spec, which only the local layout has yet; fix: "
                "get_gpt_layer_local_spec(multi_latent_attention=True) (app: "
                "--transformer-impl local)"
            )
        self.config, self.layer_number = config, layer_number
        d, groups, sp = config.kv_channels, config.num_query_groups, config.sequence_parallel
        assert d is not None and groups is not None, "TransformerConfig.__post_init__ fills them"
        self.d = d
        self.groups_per_rank = divide(groups, tp_size, "num_query_groups")
        self.q_per_group = config.num_attention_heads // groups
        qkv_size = config.query_projection_size + 2 * config.kv_projection_size
        self.linear_qkv = build_linear(
            submodules.linear_qkv,
            config,
            config.hidden_size,
            qkv_size,
            tp_group=tp_group,
            bias=config.add_bias_linear or config.add_qkv_bias,
            init_method=init_method,
            sequence_parallel=sp,
            params_dtype=config.params_dtype,
        )
        self.core_attention = build_module(
            submodules.core_attention,
            config,
            layer_number=layer_number,
            tp_size=tp_size,
            tp_group=tp_group,
            init_method=init_method,
        )
        self.linear_proj = build_linear(
            submodules.linear_proj,
            config,
            config.query_projection_size,
            config.hidden_size,
            tp_group=tp_group,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            init_method=output_layer_init_method,
            skip_bias_add=True,
            sequence_parallel=sp,
            params_dtype=config.params_dtype,
        )
        self.q_layernorm = self._qk_norm(submodules.q_layernorm, tp_size)
        self.k_layernorm = self._qk_norm(submodules.k_layernorm, tp_size)

    def _qk_norm(self, spec: Any, tp_size: int) -> Any:
        if spec is None or not self.config.qk_layernorm:
            return None
        # Each tp rank normalises different heads with the same weight: its grad is a
        # partial sum over tp, all-reduced like the sequence-parallel norms (Megatron).
        return build_module(spec, self.config, self.d, sequence_parallel=tp_size > 1)

    def split_qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`[s, b, (nq+2ng) d / t]` -> q `[s, b, nq/t, d]`, k, v `[s, b, ng/t, d]`."""
        s, b = mixed.shape[:2]
        mixed = mixed.view(s, b, self.groups_per_rank, (self.q_per_group + 2) * self.d)
        q, k, v = torch.split(mixed, [self.q_per_group * self.d, self.d, self.d], dim=3)
        return q.reshape(s, b, -1, self.d), k, v

    def forward(
        self, hidden: torch.Tensor, attention_mask: Any = None, rotary: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`[s, b, h]` (SP: `[s/t, b, h]`) -> (`[s, b, h]` (SP: `[s/t, b, h]`), bias)."""
        mixed, _ = self.linear_qkv(hidden)
        q, k, v = self.split_qkv(mixed)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
        if recompute_now(self.config, "core_attn", self.training):
            ctx = checkpoint(self.core_attention, q, k, v, attention_mask)
        else:
            ctx = self.core_attention(q, k, v, attention_mask)
        return self.linear_proj(ctx)
