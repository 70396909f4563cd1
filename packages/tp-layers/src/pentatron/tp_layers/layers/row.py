"""`RowParallelLinear`: `Y = X A + b` with A split along its input (row) dim over tp.

Rank r holds `A_r` of shape `[out, in/t]`, multiplies its slice of X and the partial
products are summed over tp:

    input_is_parallel=False: [s, b, in] -> split last dim -> [s, b, in/t]
    [s, b, in/t] -> X_r A_r^T -> partial [s, b, out]
    no SP: -> g: all-reduce(tp) -> [s, b, out]      (backward: identity)
    SP:    -> reduce-scatter(tp) -> [s/t, b, out]  (backward: all-gather)
    then + b (b is replicated; with SP its grad is partial per rank, see `sequence_parallel`
    attribute and `sync_sequence_parallel_grads`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..init import InitMethod
from ..mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from ..utils import TPConfigError, divide, group_size
from .common import check_last_dim, default_init, make_bias, make_weight, resolve_layer_group
from .linear import linear_with_grad_accumulation_and_async_allreduce


class RowParallelLinear(torch.nn.Module):
    """Linear layer sharded on the input dim (Megatron's `RowParallelLinear`).

    Args:
        input_size, output_size: full sizes; `input_size` must divide by t.
        input_is_parallel: the input is already `[..., in/t]` (the output of a column layer);
            else it is split here.
        sequence_parallel: reduce-scatter the output to `[s/t, b, out]` instead of
            all-reducing it (needs input_is_parallel).
        skip_bias_add: return the bias instead of adding it.
        Other arguments as in `ColumnParallelLinear`.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group: Any = None,
        bias: bool = True,
        input_is_parallel: bool = False,
        init_method: InitMethod | None = None,
        stride: int = 1,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        gradient_accumulation_fusion: bool = True,
        is_expert: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise TPConfigError(
                "sequence_parallel=True with input_is_parallel=False: the rule: a "
                "sequence-parallel row layer takes the sharded output of a column layer; fix: "
                "set input_is_parallel=True"
            )
        self.tp_group = resolve_layer_group(tp_group, is_expert)
        self.tp_size = group_size(self.tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(
            input_size,
            self.tp_size,
            "input_size",
            fix=f"choose input_size as a multiple of tp={self.tp_size}",
        )
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel, self.is_expert = sequence_parallel, is_expert
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        init = default_init(init_method)
        self.weight = make_weight(
            (output_size, self.input_size_per_partition),
            (output_size, input_size),
            1,
            stride,
            init,
            self.tp_group,
            params_dtype,
            device,
        )
        # torch stubs lack .allreduce
        self.weight.allreduce = not is_expert  # type: ignore[attr-defined]
        if bias:
            self.bias = make_bias(output_size, params_dtype, device, sharded=False)
            # torch stubs lack .allreduce
            self.bias.allreduce = not is_expert  # type: ignore[attr-defined]
            # Each rank adds the bias to s/t tokens only: its grad is a partial sum over tp.
            # torch stubs lack .sequence_parallel
            self.bias.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`[s, b, in/t]` (or `[s, b, in]`) -> `([s, b, out] or [s/t, b, out] with SP, bias)`."""
        expected = self.input_size_per_partition if self.input_is_parallel else self.input_size
        field = "input_size/t" if self.input_is_parallel else "input_size"
        check_last_dim(x, expected, "RowParallelLinear", field)
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        partial = linear_with_grad_accumulation_and_async_allreduce(
            x,
            self.weight,
            None,
            self.gradient_accumulation_fusion,
            False,
            False,
            self.tp_group,
        )
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            out = reduce_from_tensor_model_parallel_region(partial, self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return out, self.bias if self.skip_bias_add else None
        return out + self.bias, None

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
