"""Rotary position embedding (RoPE), non-interleaved rotate-half (Hugging Face Llama's form).

The first `rotary_dim = kv_channels * rotary_percent` dims of each head are rotated; the
pair of dim i is dim i + rotary_dim/2. Llama-3 scaling rescales the inverse frequencies.

    position_ids [b, s] -> (cos, sin) each [s, b, 1, rotary_dim]
    q or k [s, b, n, d] -> rotated [s, b, n, d]
"""

from __future__ import annotations

import math

import torch

from .config import RopeScaling, TransformerConfig


def rope_inv_freq(dim: int, base: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """`1 / base^(2i/dim)` for i < dim/2, fp32, then Llama-3 scaling if given."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq if scaling is None else llama3_scale(inv_freq, scaling)


def llama3_scale(inv_freq: torch.Tensor, sc: RopeScaling) -> torch.Tensor:
    """Keep high frequencies, divide low ones by `factor`, interpolate in between."""
    old = sc.original_max_position_embeddings
    low_wavelen, high_wavelen = old / sc.low_freq_factor, old / sc.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / sc.factor, inv_freq)
    smooth = (old / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (Eq. 21): `0.1 mscale ln(factor) + 1` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(dim: int, base: float, config: TransformerConfig) -> torch.Tensor:
    """YaRN (arXiv 2309.00071) as Megatron's and DeepSeek's: the frequencies that turn fewer
    than `beta_slow` times over the original context are divided by the factor, those
    turning more than `beta_fast` times kept, a linear ramp in between."""
    factor, original = config.rotary_scaling_factor, config.yarn_original_max_position_embeddings
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(config.yarn_beta_fast), dim_of(config.yarn_beta_slow)
    if config.yarn_correction_range_round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)
    keep = 1.0 - ramp.clamp(0, 1)  # 1: extrapolate (keep), 0: interpolate (divide)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def yarn_concentration(config: TransformerConfig) -> float:
    """The factor on cos and sin (Megatron's `_yarn_get_concentration_factor`)."""
    factor = config.rotary_scaling_factor
    return yarn_mscale(factor, config.mscale) / yarn_mscale(factor, config.mscale_all_dim)


def uses_yarn(config: TransformerConfig) -> bool:
    """YaRN's frequencies: position_embedding_type "yarn", or MLA with a scaling factor."""
    if config.position_embedding_type == "yarn":
        return True
    return config.multi_latent_attention and config.rotary_scaling_factor != 1.0


class RotaryEmbedding(torch.nn.Module):
    """Produces `(cos, sin)` for given positions; holds no parameters (not in state dicts).
    With `yarn` (position_embedding_type="yarn", Megatron's YarnRotaryEmbedding for standard
    attention: gpt-oss) or multi-latent attention with `rotary_scaling_factor` > 1, YaRN's
    frequencies, and cos and sin scaled by its concentration factor (Megatron's attention
    passes that factor as `mscale` where it applies RoPE)."""

    inv_freq: torch.Tensor  # a buffer (registered in __init__)

    def __init__(self, config: TransformerConfig, yarn: bool = False) -> None:
        super().__init__()
        self.dim = config.rotary_dim
        scaling = config.rope_scaling
        assert not isinstance(scaling, dict), "TransformerConfig.__post_init__ makes it RopeScaling"
        self.concentration = 1.0
        if yarn or uses_yarn(config):
            inv = yarn_inv_freq(self.dim, config.rotary_base, config)
            self.concentration = yarn_concentration(config)
        else:
            inv = rope_inv_freq(self.dim, config.rotary_base, scaling)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(
        self, position_ids: torch.Tensor | None, seq_len: int, device=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids `[b, s]` (None: 0..s-1 for all) -> cos, sin `[s, b | 1, 1, dim]` fp32."""
        inv = self.inv_freq.to(device or self.inv_freq.device)
        if position_ids is None:
            pos = torch.arange(seq_len, device=inv.device, dtype=torch.float32)[None]
        else:
            pos = position_ids.to(device=inv.device, dtype=torch.float32)
        freqs = pos[..., None] * inv  # [b, s, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1).transpose(0, 1)[:, :, None, :]
        if self.concentration != 1.0:
            return emb.cos() * self.concentration, emb.sin() * self.concentration
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`[s, b, n, d]` -> same, the first `cos.size(-1)` dims rotated (rest passed through)."""
    dim = cos.size(-1)
    rot, rest = x[..., :dim], x[..., dim:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rot = rot * cos + rotate_half(rot) * sin
    return rot if rest.numel() == 0 else torch.cat((rot, rest), dim=-1)
