"""The MLP's activation on fc1's output, SwiGLU as one autograd function.

    [.., F1] -> [.., F]   SwiGLU: F1 = 2F, [gate, up] -> silu(gate) * up;  GeLU: F1 = F
    quick-GeGLU (gpt-oss): [gate, up] -> quick_gelu(gate) * up, quick_gelu(x) = x sigmoid(1.702 x)

A gated activation reads `config.activation_func_clamp_value` c and `glu_linear_offset` o
as Megatron's unfused GLU does: `act(clamp(gate, max=c)) * (clamp(up, -c, c) + o)`
(gpt-oss: c = 7, o = 1). Those run in autograd; only plain SwiGLU has the fused function.

Written as `silu(gate) * up` in autograd, SwiGLU keeps three tensors for backward: fc1's
output (gate and up are views of it), silu(gate) and, in fc2, the product. With
`config.bias_activation_fusion`, `swiglu` keeps only fc1's output and recomputes silu(gate)
in backward, as Megatron's fused bias-SwiGLU does: `F` fewer elements per token and layer,
for one more silu per element in backward (on a CPU about 0.1 ms at [128, 2, 2 x 688]).
Its gradients are the autograd form's (silu_backward of `g * up`, and `g * silu(gate)`),
computed by the same kernels, so they are bitwise equal; they are written into one
`[.., 2F]` buffer instead of being concatenated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.chunk(x, 2, dim=-1)
        ctx.save_for_backward(x)
        return F.silu(gate) * up

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        gate, up = torch.chunk(x, 2, dim=-1)
        grad_x = torch.empty_like(x)
        grad_gate, grad_up = torch.chunk(grad_x, 2, dim=-1)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        torch.mul(grad, F.silu(gate), out=grad_up)
        return grad_x


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """`[.., 2F]` holding `[gate, up]` -> `silu(gate) * up` `[.., F]`, keeping only `x`."""
    return _SwiGLU.apply(x)


def mlp_activation(config: Any, x: torch.Tensor) -> torch.Tensor:
    """fc1's output `[.., F1]` -> fc2's input `[.., F]` by `config.activation`."""
    if not config.gated_linear_unit:
        return config.activation_func(x)
    clamp, offset = config.activation_func_clamp_value, config.glu_linear_offset
    plain = clamp is None and offset == 0.0
    if (
        plain
        and config.activation == "swiglu"
        and config.bias_activation_fusion
        and not torch.compiler.is_compiling()
    ):
        return swiglu(x)
    gate, up = torch.chunk(x, 2, dim=-1)
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(min=-clamp, max=clamp)
    if offset != 0.0:
        up = up + offset
    return config.activation_func(gate) * up
