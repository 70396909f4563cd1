"""MXFP4 (OCP microscaling FP4) weights, as OpenAI's gpt-oss checkpoints store their experts.

A tensor `[..., out, in]` is stored as two uint8 tensors:

    <name>_blocks [..., out, in/32, 16]   two E2M1 codes per byte, low nibble first
    <name>_scales [..., out, in/32]       one E8M0 exponent per block of 32: 2^(scale - 127)

E2M1 codes 0..7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 the same values negated.
Every value is (code value) x 2^(scale - 127), exact in fp32 for the scales a checkpoint
holds (|scale - 127| < 126), so dequantising to fp32 and then casting to the parameters'
dtype rounds once, as a direct dequantisation to that dtype would.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`blocks [..., G, 16]` uint8 + `scales [..., G]` uint8 -> `[..., G * 32]` fp32."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}; "
            "the rule: gpt-oss's *_blocks / *_scales tensors; fix: check the checkpoint"
        )
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: the rule: "
            f"blocks [..., G, {BLOCK // 2}] with scales [..., G]; fix: check the checkpoint"
        )
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1)  # [..., G, 16, 2] low first
    values = lut[codes.long()].flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)


def held(name: str, keys: set[str]) -> bool:
    """Whether a checkpoint holding `keys` has tensor `name`, as itself or in MXFP4
    (`name_blocks` and `name_scales`)."""
    return name in keys or (name + "_blocks" in keys and name + "_scales" in keys)
