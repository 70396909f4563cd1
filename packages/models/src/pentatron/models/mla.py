"""Multi-latent attention (DeepSeek-V2/V3): Megatron's `MLASelfAttention`, local spec.

n heads (n/t on a tp rank), d_qk = qk_head_dim, d_pe = qk_pos_emb_head_dim, d_v =
v_head_dim, r_q = q_lora_rank, r_kv = kv_lora_rank:

    x [s, b, h] (SP: [s/t, b, h])
    q:  r_q None: linear_q_proj (column) -> [s, b, n/t (d_qk + d_pe)]
        else: linear_q_down_proj (duplicated) -> [s, b, r_q] (SP: [s/t, b, r_q])
              -> q_layernorm -> linear_q_up_proj (column; SP: all-gathers r_q) -> as above
    kv: linear_kv_down_proj (duplicated) -> [s, b, r_kv + d_pe] (SP: [s/t, ...])
        latent [s(/t), b, r_kv] -> kv_layernorm -> linear_kv_up_proj (column)
          -> k_nope [s, b, n/t, d_qk], v [s, b, n/t, d_v]
        k_pe [s, b, 1, d_pe] (SP: all-gathered over tp): one for every head
    RoPE on q_pe, k_pe (their dims de-interleaved first: DeepSeek's pairs (2i, 2i+1), as
    Megatron's `mla_rotary_interleaved` and transformers' `rope_interleave`)
    q = [q_nope, q_pe], k = [k_nope, k_pe] -> causal SDPA, scale 1/sqrt(d_qk + d_pe)
      (YaRN, rotary_scaling_factor > 1: its frequencies and cos/sin factor in `rope`, and
      the scale times mscale(factor, mscale_all_dim)^2)
      -> [s, b, n/t d_v] -> linear_proj (row: all-reduce, SP reduce-scatter) -> [s, b, h]

The down-projections are duplicated over tp (tp-layers' `DuplicatedLinear`: the whole weight
on every rank), as Megatron's transformer-engine spec builds them (`TELinear`,
`parallel_mode="duplicated"`), its default: no all-gather of the hidden states, which are
far wider than the latents (DeepSeek-V3: 7168 against 1536 and 576); under SP only k_pe
(d_pe wide) is gathered, and the up-projections gather their latents as any column layer.
(Megatron's local spec splits them by rows and gathers the hidden states twice per layer
under SP, then the latents; the same math.) Every rank's heads use the same k_pe, so its
gradient is summed over tp (`copy_to_tensor_model_parallel_region`; under SP the gather's
reduce-scatter) before it reaches the down-projection; the latents' gradients are summed by
the up-projections' backward. Under SP the latent norms and the down-projections see this
rank's tokens only, so their weights are marked sequence-parallel (grads all-reduced over
tp, as Megatron's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from pentatron.tp_layers import (
    checkpoint,
    copy_to_tensor_model_parallel_region,
    divide,
    gather_from_sequence_parallel_region,
)

from .config import ModelConfigError, TransformerConfig
from .recompute import CheckpointWithoutOutput, recompute_now
from .rope import apply_rotary_pos_emb, yarn_mscale
from .spec import build_linear, build_module


@dataclass
class MLASelfAttentionSubmodules:
    linear_q_proj: Any = None
    linear_q_down_proj: Any = None
    linear_q_up_proj: Any = None
    linear_kv_down_proj: Any = None
    linear_kv_up_proj: Any = None
    core_attention: Any = None
    linear_proj: Any = None
    q_layernorm: Any = None
    kv_layernorm: Any = None


def mla_softmax_scale(config: TransformerConfig) -> float:
    """`1/sqrt(d_qk + d_pe)`, times YaRN's `mscale(factor, mscale_all_dim)^2` (DeepSeek's)."""
    m = yarn_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
    return m * m / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)


def apply_mla_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`[s, b, n, d_pe]`: dims (0, 2, 4, ..., 1, 3, 5, ...) then rotate-half RoPE."""
    return apply_rotary_pos_emb(torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1), cos, sin)


class MLASelfAttention(torch.nn.Module):
    """`forward(x, attention_mask, rotary)` -> `(out, bias)`, as `SelfAttention`."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLASelfAttentionSubmodules,
        layer_number: int,
        tp_group: Any = None,
        tp_size: int = 1,
        init_method: Any = None,
        output_layer_init_method: Any = None,
    ) -> None:
        super().__init__()
        if not config.multi_latent_attention:
            raise ModelConfigError(
                "MLASelfAttention with multi_latent_attention=False: the rule: the MLA spec "
                "builds MLA layers; fix: set multi_latent_attention=True, or use "
                "get_gpt_layer_local_spec() without multi_latent_attention"
            )
        self.config, self.layer_number, self.tp_group = config, layer_number, tp_group
        self.heads = divide(config.num_attention_heads, tp_size, "num_attention_heads")
        self.d_qk, self.d_pe, self.d_v = (
            config.qk_head_dim,
            config.qk_pos_emb_head_dim,
            config.v_head_dim,
        )
        n, h = config.num_attention_heads, config.hidden_size

        def column(spec: Any, size_in: int, size_out: int) -> Any:
            return build_linear(
                spec,
                config,
                size_in,
                size_out,
                tp_group=tp_group,
                bias=False,
                init_method=init_method,
                sequence_parallel=config.sequence_parallel,
                params_dtype=config.params_dtype,
            )

        q_out = n * (self.d_qk + self.d_pe)
        if config.q_lora_rank is None:
            self.linear_q_proj = column(submodules.linear_q_proj, h, q_out)
        else:
            r = config.q_lora_rank
            self.linear_q_down_proj = column(submodules.linear_q_down_proj, h, r)
            self.linear_q_up_proj = column(submodules.linear_q_up_proj, r, q_out)
            self.q_layernorm = self._norm(submodules.q_layernorm, r)
        r_kv = config.kv_lora_rank
        self.linear_kv_down_proj = column(submodules.linear_kv_down_proj, h, r_kv + self.d_pe)
        self.linear_kv_up_proj = column(
            submodules.linear_kv_up_proj, r_kv, n * (self.d_qk + self.d_v)
        )
        self.kv_layernorm = self._norm(submodules.kv_layernorm, r_kv)
        self._check_duplicated()
        self.core_attention = build_module(
            submodules.core_attention,
            config,
            layer_number=layer_number,
            tp_size=tp_size,
            softmax_scale=mla_softmax_scale(config),
        )
        self.linear_proj = build_linear(
            submodules.linear_proj,
            config,
            n * self.d_v,
            h,
            tp_group=tp_group,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            init_method=output_layer_init_method,
            skip_bias_add=True,
            sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype,
        )

    def _norm(self, spec: Any, size: int) -> Any:
        """A latent's norm (Megatron builds them with qk_layernorm), or None."""
        if spec is None or not self.config.qk_layernorm:
            return None
        return build_module(spec, self.config, size)  # SP-marked under SP (see module doc)

    def _check_duplicated(self) -> None:
        downs = {"linear_kv_down_proj": self.linear_kv_down_proj}
        if self.config.q_lora_rank is not None:
            downs["linear_q_down_proj"] = self.linear_q_down_proj
        for name, down in downs.items():
            if not getattr(down, "duplicated", False):
                raise ModelConfigError(
                    f"MLASelfAttentionSubmodules.{name}={type(down).__name__}: the rule: the "
                    "down-projections are duplicated over tp (the whole weight on every rank, "
                    "what checkpoints and conversion expect); fix: DuplicatedLinear"
                )

    @staticmethod
    def _norm_of(latent: torch.Tensor, norm: Any) -> torch.Tensor:
        return latent if norm is None else norm(latent)

    def latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`[s(/t), b, h]` -> the up-projections' inputs: q's (its normed latent, or x),
        kv's normed latent (both `[s(/t), b, r]`: this rank's tokens under SP), and k_pe
        `[s, b, 1, d_pe]` before RoPE."""
        q_in = x
        if self.config.q_lora_rank is not None:
            q_in = self._norm_of(self.linear_q_down_proj(x)[0], self.q_layernorm)
        combined, _ = self.linear_kv_down_proj(x)
        latent, k_pe = torch.split(combined, [self.config.kv_lora_rank, self.d_pe], dim=-1)
        if self.config.sequence_parallel:  # every token's k_pe; grad: reduce-scattered (summed)
            k_pe = gather_from_sequence_parallel_region(k_pe.contiguous(), self.tp_group)
        else:
            k_pe = copy_to_tensor_model_parallel_region(k_pe, self.tp_group)  # grad: summed
        return q_in, self._norm_of(latent, self.kv_layernorm), k_pe.unsqueeze(2)

    def up_and_rope(
        self, q_in: torch.Tensor, kv_in: torch.Tensor, k_pe: torch.Tensor, rotary: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The up-projections and RoPE: q, k `[s, b, n/t, d_qk + d_pe]`, v `[s, b, n/t, d_v]`."""
        up_q = self.linear_q_proj if self.config.q_lora_rank is None else self.linear_q_up_proj
        q, _ = up_q(q_in)
        q = q.view(*q.shape[:2], self.heads, self.d_qk + self.d_pe)
        kv, _ = self.linear_kv_up_proj(kv_in)
        kv = kv.view(*kv.shape[:2], self.heads, self.d_qk + self.d_v)
        k_nope, v = torch.split(kv, [self.d_qk, self.d_v], dim=-1)
        q_nope, q_pe = torch.split(q, [self.d_qk, self.d_pe], dim=-1)
        if rotary is not None:
            cos, sin = rotary
            q_pe, k_pe = apply_mla_rope(q_pe, cos, sin), apply_mla_rope(k_pe, cos, sin)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.heads, -1)], dim=-1)
        return q, k, v

    def _packed_up_and_rope(self, q_in, kv_in, k_pe, cos, sin) -> torch.Tensor:
        """`up_and_rope` as one tensor `[s, b, n/t, 2 (d_qk + d_pe) + d_v]` (q, k, v), what
        an output-discarding checkpoint takes."""
        rotary = None if cos is None else (cos, sin)
        return torch.cat(self.up_and_rope(q_in, kv_in, k_pe, rotary), dim=-1)

    def forward(
        self, hidden: torch.Tensor, attention_mask: Any = None, rotary: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`[s, b, h]` (SP: `[s/t, b, h]`) -> (`[s, b, h]` (SP: `[s/t, b, h]`), bias).

        Selective recompute "mla_up_proj" (Megatron's): the up-projections and RoPE run
        without keeping their outputs (q, k, v: what the core attention keeps), which are
        recomputed from the latents just before the core attention's backward."""
        q_in, kv_in, k_pe = self.latents(hidden)
        up = None
        if recompute_now(self.config, "mla_up_proj", self.training):
            up = CheckpointWithoutOutput()
            cos, sin = rotary if rotary is not None else (None, None)
            qkv = up.checkpoint(self._packed_up_and_rope, q_in, kv_in, k_pe, cos, sin)
            qk = self.d_qk + self.d_pe
            q, k, v = torch.split(qkv, [qk, qk, self.d_v], dim=-1)
        else:
            q, k, v = self.up_and_rope(q_in, kv_in, k_pe, rotary)
        if recompute_now(self.config, "core_attn", self.training):
            ctx = checkpoint(self.core_attention, q, k, v, attention_mask)
        else:
            ctx = self.core_attention(q, k, v, attention_mask)
        if up is not None:
            up.discard_output_and_register_recompute(ctx)
        return self.linear_proj(ctx)
