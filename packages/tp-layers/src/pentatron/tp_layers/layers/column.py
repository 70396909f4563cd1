"""`ColumnParallelLinear`: `Y = X A + b` with A split along its output (column) dim over tp.

Rank r holds `A_r` of shape `[out/t, in]` and computes `Y_r = X A_r^T + b_r`:

    no SP:  [s, b, in]   -> f (identity; all-reduce(tp) of the grad) -> [s, b, out/t]
    SP:     [s/t, b, in] -> all-gather(tp) (reduce-scatter of the grad) -> [s, b, out/t]
    gather_output: [s, b, out/t] -> all-gather(tp) on the last dim -> [s, b, out]

`forward` returns `(output, bias)`: bias is None unless `skip_bias_add`, in which case it is
not added and is returned so the caller can fuse it into the next op.
"""

from __future__ import annotations

from typing import Any

import torch

from ..init import InitMethod
from ..mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
)
from ..utils import TPConfigError, divide, group_size
from .common import check_last_dim, default_init, make_bias, make_weight, resolve_layer_group
from .linear import linear_with_grad_accumulation_and_async_allreduce


class ColumnParallelLinear(torch.nn.Module):
    """Linear layer sharded on the output dim (Megatron's `ColumnParallelLinear`).

    Args:
        input_size, output_size: the full (unsharded) sizes; `output_size` must divide by t.
        tp_group: ProcessGroup, DeviceMesh or (mesh, dim); None: the default grid's tp
            (etp for `is_expert`).
        init_method: fills the full `[output_size, input_size]` master weight (default
            N(0, 0.02^2)); this rank keeps its shard, so every t gives the TP=1 weights.
        stride: number of fused blocks along the output dim (3 for a fused QKV weight,
            2 for gate/up); each rank takes its 1/t of every block.
        sequence_parallel: the input is `[s/t, b, in]` and is all-gathered here.
        async_tensor_model_parallel_allreduce: all-reduce the input grad inside the matmul's
            backward, overlapped with the weight-grad GEMM (else in a separate f mapping).
        gradient_accumulation_fusion: accumulate dW into `weight.main_grad` when it exists.
        regather_input: with sequence parallelism keep only `[s/t, b, in]` for backward and
            all-gather it again there (Megatron's default; saves (t-1)/t of that memory).
        skip_weight_param_allocation: no weight parameter; pass `weight=` to `forward`
            (a tied output layer).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group: Any = None,
        bias: bool = True,
        gather_output: bool = False,
        init_method: InitMethod | None = None,
        stride: int = 1,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        sequence_parallel: bool = False,
        async_tensor_model_parallel_allreduce: bool = True,
        gradient_accumulation_fusion: bool = True,
        regather_input: bool = True,
        is_expert: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if gather_output and sequence_parallel:
            raise TPConfigError(
                "gather_output=True with sequence_parallel=True: the rule: a sequence-parallel "
                "column layer's output stays sharded for the row layer that follows; fix: set "
                "gather_output=False, or sequence_parallel=False"
            )
        self.tp_group = resolve_layer_group(tp_group, is_expert)
        self.tp_size = group_size(self.tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(
            output_size,
            self.tp_size,
            "output_size",
            fix=f"choose output_size as a multiple of tp={self.tp_size} (or pad it)",
        )
        self.gather_output, self.skip_bias_add, self.stride = gather_output, skip_bias_add, stride
        self.sequence_parallel = sequence_parallel
        self.async_allreduce = async_tensor_model_parallel_allreduce
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.regather_input, self.is_expert = regather_input, is_expert
        self._build_params(
            bias, default_init(init_method), skip_weight_param_allocation, params_dtype, device
        )

    def _build_params(
        self,
        bias: bool,
        init_method: InitMethod,
        skip_weight: bool,
        dtype: torch.dtype | None,
        device: Any,
    ) -> None:
        shard = (self.output_size_per_partition, self.input_size)
        if skip_weight:
            self.register_parameter("weight", None)
        else:
            self.weight = make_weight(
                shard,
                (self.output_size, self.input_size),
                0,
                self.stride,
                init_method,
                self.tp_group,
                dtype,
                device,
            )
            # DDP reads this for expert params; torch stubs lack .allreduce
            self.weight.allreduce = not self.is_expert  # type: ignore[attr-defined]
        if bias:
            self.bias = make_bias(self.output_size_per_partition, dtype, device, True, self.stride)
            # torch stubs lack .allreduce
            self.bias.allreduce = not self.is_expert  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def _weight_for(self, weight: torch.Tensor | None) -> torch.Tensor:
        if weight is None:
            if self.weight is None:
                raise TPConfigError(
                    "ColumnParallelLinear built with skip_weight_param_allocation=True needs "
                    "forward(x, weight=...); fix: pass the (tied) weight shard"
                )
            return self.weight
        expected = (self.output_size_per_partition, self.input_size)
        if tuple(weight.shape) != expected:
            raise TPConfigError(
                f"ColumnParallelLinear: weight passed to forward has shape "
                f"{tuple(weight.shape)}; the rule: it is this rank's shard "
                f"[output_size/t, input_size] = {list(expected)}; fix: pass that shard"
            )
        return weight

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`[s, b, in]` (or `[s/t, b, in]` with SP) -> `([s, b, out/t] or [s, b, out], bias)`."""
        # A weight passed in (the tied embedding) has a second use (the lookup) whose grad
        # autograd sums with ours before DDP's hook sees it: fusing ours into main_grad
        # would make the hook drop the lookup's part, so that weight takes the plain path.
        fuse = self.gradient_accumulation_fusion and weight is None
        weight = self._weight_for(weight)
        check_last_dim(x, self.input_size, "ColumnParallelLinear", "input_size")
        parallel = self.tp_size > 1
        allreduce = self.async_allreduce and parallel and not self.sequence_parallel
        if parallel and not allreduce and not self.sequence_parallel:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        bias = None if self.skip_bias_add else self.bias
        out = linear_with_grad_accumulation_and_async_allreduce(
            x,
            weight,
            bias,
            fuse,
            allreduce,
            self.sequence_parallel,
            self.tp_group,
            self.regather_input,
        )
        if self.gather_output:
            out = gather_from_tensor_model_parallel_region(out, self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, tp={self.tp_size}, "
            f"bias={self.bias is not None}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}, stride={self.stride}"
        )
