"""`DuplicatedLinear`: `Y = X A^T + b` with the whole A on every tp rank (Megatron's TE
`parallel_mode="duplicated"`, which its TE spec uses for multi-latent attention's
down-projections).

No communication in either direction:

    no SP:  [s, b, in]   -> [s, b, out]   (every tp rank computes the same)
    SP:     [s/t, b, in] -> [s/t, b, out] (this rank's tokens only)

Against a column-parallel layer this trades t copies of a small weight (and, without SP,
t-fold the GEMM) for the all-gather of a wide input: worth it where `out` is much narrower
than `in` (a down-projection: DeepSeek-V3's 7168 -> 1536 and 576). Under SP each rank's dW
sums only its tokens, so the weight (and bias) are marked `sequence_parallel` and summed
over tp after backward, as a norm's (`sync_sequence_parallel_grads`, or the optimizer's
finalize step); without SP every rank's dW is already the whole one. The weight is drawn
from the same master as a column layer's (`init_method` on the full shape), so tp ranks
hold equal copies and any t gives the tp=1 weights.
"""

from __future__ import annotations

from typing import Any

import torch

from ..grads import mark_sequence_parallel
from ..init import InitMethod
from ..utils import group_size
from .common import check_last_dim, default_init, make_bias, make_weight, resolve_layer_group
from .linear import linear_with_grad_accumulation_and_async_allreduce


class DuplicatedLinear(torch.nn.Module):
    """A linear layer whose weight every tp rank holds whole (see the module docstring).

    Args:
        input_size, output_size: the layer's sizes (nothing is split).
        tp_group: ProcessGroup, DeviceMesh or (mesh, dim); None: the default grid's tp.
            Only its size is used: with SP and t > 1 the params are marked
            `sequence_parallel`.
        init_method: fills the `[output_size, input_size]` weight (default N(0, 0.02^2)).
        sequence_parallel: the input is this rank's `[s/t, b, in]` tokens.
        gradient_accumulation_fusion: accumulate dW into `weight.main_grad` when it exists.
    """

    duplicated = True  # read by layers that accept it in place of a column-parallel linear

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group: Any = None,
        bias: bool = False,
        init_method: InitMethod | None = None,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        gradient_accumulation_fusion: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.tp_group = resolve_layer_group(tp_group, False)
        self.tp_size = group_size(self.tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.sequence_parallel, self.skip_bias_add = sequence_parallel, skip_bias_add
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        full = (output_size, input_size)
        # group None: the whole master weight, drawn as a column layer draws its master
        self.weight = make_weight(
            full, full, 0, 1, default_init(init_method), None, params_dtype, device
        )
        self.weight.allreduce = True  # type: ignore[attr-defined]  # DDP's; not in torch stubs
        params = [self.weight]
        if bias:
            self.bias = make_bias(output_size, params_dtype, device, False)
            params.append(self.bias)
        else:
            self.register_parameter("bias", None)
        if sequence_parallel and self.tp_size > 1:
            mark_sequence_parallel(*params)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`[s, b, in]` (SP: `[s/t, b, in]`) -> `([s(/t), b, out], bias)`; bias is returned,
        not added, with `skip_bias_add`."""
        check_last_dim(x, self.input_size, "DuplicatedLinear", "input_size")
        bias = None if self.skip_bias_add else self.bias
        out = linear_with_grad_accumulation_and_async_allreduce(
            x, self.weight, bias, self.gradient_accumulation_fusion, False, False, self.tp_group
        )
        return out, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, duplicated over tp={self.tp_size}, "
            f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}"
        )
