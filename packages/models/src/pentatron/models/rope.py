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


class RotaryEmbedding(torch.nn.Module):
    """Produces `(cos, sin)` for given positions; holds no parameters (not in state dicts)."""

    inv_freq: torch.Tensor  # a buffer (registered in __init__)

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.dim = config.rotary_dim
        scaling = config.rope_scaling
        assert not isinstance(scaling, dict), "TransformerConfig.__post_init__ makes it RopeScaling"
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
