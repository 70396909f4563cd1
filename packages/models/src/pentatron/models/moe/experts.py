"""Routed experts: E_local MLPs with stacked parameters, run as a loop or a grouped GEMM.

Parameters (this rank: ep rank r holds global experts r*E/ep ... (r+1)*E/ep - 1, etp rank q
holds the q-th tp shard of each, exactly like the dense MLP's fc1/fc2 at tp):
    linear_fc1.weight [E_local, F1/etp, h]  (F1 = 2 ffn for SwiGLU: rank q holds [gate_q, up_q])
    linear_fc1.bias   [E_local, F1/etp]
    linear_fc2.weight [E_local, h, ffn/etp]
    linear_fc2.bias   [E_local, h]          (added on etp rank 0 only: the etp partial sums
                                             are reduced by the dispatcher)
Every parameter carries `allreduce = False` (reduced over expert data parallel, "edp").

    x [N, h] (expert-major, tokens_per_expert[e] rows each) -> [N, h] (etp-partial sums)

`SequentialMLP` loops over experts; `GroupedMLP` runs one `torch._grouped_mm` per linear
wherever torch runs it (probed once per device and dtype: CUDA bf16 on SM90+; CPU fp32 and
bf16 in recent builds, e.g. 2.13) and the rows are 16-byte aligned, and otherwise the same
loop with identical numerics. Both load the same checkpoint; the grouped path agrees with the
loop to fp32 rounding (bias added after the GEMM instead of inside it).

"moe_act" selective recompute (Megatron's; needs moe_grouped_gemm): the activation runs
output-discarding checkpointed (recompute.py): fc2's input is freed after fc2 and
recomputed from fc1's output in backward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from pentatron.parallel_state import current_device
from pentatron.tp_layers import (
    DeferredWeightGrad,
    deferring_store,
    set_tensor_model_parallel_attributes,
    shard_of,
)

from ..activations import mlp_activation
from ..recompute import CheckpointWithoutOutput, recompute_now


class ExpertLinear(torch.nn.Module):
    """Stacked weights `[E_local, out, in]` (+ bias `[E_local, out]`) of one expert linear."""

    def __init__(self, experts: int, out_features: int, in_features: int, bias: bool, dtype):
        super().__init__()
        device = current_device()
        self.weight = torch.nn.Parameter(
            torch.empty(experts, out_features, in_features, dtype=dtype, device=device)
        )
        self.bias = (
            torch.nn.Parameter(torch.zeros(experts, out_features, dtype=dtype, device=device))
            if bias
            else None
        )
        for p in self.parameters():
            p.allreduce = False  # type: ignore[attr-defined]  # a Parameter tag


def _init_stacked(weight, full_shape, init_method, ep_rank, etp_rank, etp, dim, stride) -> None:
    """Fill `weight` with its (ep, etp) part of one master `[E, ...]` drawn with `init_method`.

    Drawing the full master on every rank keeps the model identical at every layout.
    """
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    local = weight.size(0)
    master = master[ep_rank * local : (ep_rank + 1) * local]
    with torch.no_grad():
        weight.copy_(shard_of(master, dim, etp_rank, etp, stride).to(weight.dtype))


class _ExpertsLinear(torch.autograd.Function):
    """`x [N, in]` expert-major (`counts[e]` rows for expert e) -> `[N, out]`: each group
    times its expert's `weight [E, out, in]` transposed, plus its `bias [E, out]` row.

    One loop of `F.linear`s (`offs` None) or one grouped GEMM (`offs`: the groups' end rows,
    int32; no bias: GroupedMLP adds it after, with `experts_bias`). Backward computes what
    autograd computes for those ops, the same way
    (so the numbers do not change); inside a `WeightGradStore.defer()` (zero-bubble
    pipeline schedules) only dx is computed in B and dW, db are queued for W.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, counts, offs):
        ctx.save_for_backward(x, weight)
        ctx.weight, ctx.bias, ctx.counts, ctx.offs = weight, bias, counts, offs
        if offs is not None:
            return torch._grouped_mm(x, weight.transpose(1, 2), offs=offs)
        outs = [
            torch.nn.functional.linear(x_e, weight[e], None if bias is None else bias[e])
            for e, x_e in enumerate(torch.split(x, counts, dim=0))
        ]
        return torch.cat(outs, dim=0) if outs else x.new_zeros((0, weight.size(1)))

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()  # `_grouped_mm` rejects zero strides (a broadcast grad)
        dx = None
        if ctx.needs_input_grad[0]:
            if ctx.offs is not None:
                dx = torch._grouped_mm(dy, weight, offs=ctx.offs)
            else:
                parts = zip(torch.split(dy, ctx.counts, dim=0), weight)
                dx = torch.cat([dy_e.matmul(w_e) for dy_e, w_e in parts], dim=0)
        want_w, want_b = ctx.needs_input_grad[1], ctx.bias is not None and ctx.needs_input_grad[2]
        grads = functools.partial(
            _experts_weight_grads, x, dy, ctx.weight, ctx.bias, ctx.counts, ctx.offs, want_w, want_b
        )
        store = deferring_store()
        if store is not None and (want_w or want_b):
            nbytes = sum(t.numel() * t.element_size() for t in (x, dy))
            store.push(DeferredWeightGrad(grads, nbytes))
            return dx, None, None, None, None
        by_param = dict((id(t), g) for t, g in grads())
        return dx, by_param.get(id(ctx.weight)), by_param.get(id(ctx.bias)), None, None


def _experts_weight_grads(x, dy, weight, bias, counts, offs, want_w, want_b):
    """[(weight, dW [E, out, in]), (bias, db [E, out])] of `_ExpertsLinear`, as wanted."""
    pairs = []
    if want_w:
        if offs is not None:
            dw = torch._grouped_mm(x.t(), dy, offs=offs).transpose(1, 2)
        else:
            parts = zip(torch.split(dy, counts, dim=0), torch.split(x, counts, dim=0))
            dw = torch.stack([dy_e.t().matmul(x_e) for dy_e, x_e in parts])
        pairs.append((weight, dw))
    if want_b:
        pairs.append((bias, torch.stack([d.sum(0) for d in torch.split(dy, counts, dim=0)])))
    return pairs


class _ExpertsBias(torch.autograd.Function):
    """`h [N, out]` expert-major plus each row's expert `bias [E, out]`, as
    `h + bias.repeat_interleave(counts)` computes it (an `index_select` of the bias rows by
    `index [N]`, the rows' experts). Backward gives dh = dy and db as autograd does for
    that `index_select` (an `index_add` into zeros: bitwise the same); inside a
    `WeightGradStore.defer()` db is queued for W with the other expert weight grads."""

    @staticmethod
    def forward(ctx, h, bias, index):
        ctx.save_for_backward(index)
        ctx.bias, ctx.h_dtype = bias, h.dtype
        return h + bias.index_select(0, index)

    @staticmethod
    def backward(ctx, dy):
        (index,) = ctx.saved_tensors
        bias = ctx.bias
        dh = dy.to(ctx.h_dtype) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return dh, None, None
        g = dy.to(bias.dtype)

        def grads():
            return [(bias, g.new_zeros(bias.shape).index_add_(0, index, g))]

        store = deferring_store()
        if store is not None:
            store.push(DeferredWeightGrad(grads, g.numel() * g.element_size()))
            return dh, None, None
        return dh, grads()[0][1], None


def experts_bias(h: torch.Tensor, bias: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`h [N, out]` (expert-major, `counts [E]` rows per expert) + its experts' `bias`
    rows; the bias grad waits for W under a split backward (see `_ExpertsBias`)."""
    experts = torch.arange(bias.size(0), device=counts.device)
    index = experts.repeat_interleave(counts, output_size=h.size(0))
    return _ExpertsBias.apply(h, bias, index)


def experts_linear(x, weight, bias, counts, offs=None):
    """`_ExpertsLinear` (see there): `x [N, in]` expert-major -> `[N, out]`."""
    return _ExpertsLinear.apply(x, weight, bias, tuple(counts), offs)


class SequentialMLP(torch.nn.Module):
    """The local experts, one matmul pair each (Megatron's SequentialMLP numerics)."""

    def __init__(
        self,
        config: Any,
        num_local_experts: int,
        ep_rank: int = 0,
        etp_rank: int = 0,
        etp_size: int = 1,
        init_method: Any = None,
        output_layer_init_method: Any = None,
    ) -> None:
        super().__init__()
        self.config, self.num_local_experts = config, num_local_experts
        self.etp_rank, self.etp_size = etp_rank, etp_size
        h, ffn, gated = config.hidden_size, config.moe_ffn_size, config.gated_linear_unit
        f1 = ffn * (2 if gated else 1)
        bias, dtype, e = config.add_bias_linear, config.params_dtype, config.num_moe_experts
        self.linear_fc1 = ExpertLinear(num_local_experts, f1 // etp_size, h, bias, dtype)
        self.linear_fc2 = ExpertLinear(num_local_experts, h, ffn // etp_size, bias, dtype)
        # etp shards, as a dense column/row-parallel layer's: each etp rank's part of the
        # grad norm counts (an untagged param counts on etp rank 0 only, as replicated).
        # fc2's bias is replicated over etp and stays untagged.
        stride = 2 if gated else 1
        set_tensor_model_parallel_attributes(self.linear_fc1.weight, True, 1, stride)
        if self.linear_fc1.bias is not None:
            set_tensor_model_parallel_attributes(self.linear_fc1.bias, True, 1, stride)
        set_tensor_model_parallel_attributes(self.linear_fc2.weight, True, 2, 1)
        if bias and etp_size > 1:
            # Only etp rank 0 adds fc2's bias: its grad is all-reduced over etp (sync_grads).
            fc2_bias = self.linear_fc2.bias
            assert fc2_bias is not None, "ExpertLinear(bias=True) holds a bias"
            fc2_bias.expert_tp_partial = True  # type: ignore[attr-defined]  # a Parameter tag
        if init_method is not None:
            _init_stacked(
                self.linear_fc1.weight,
                (e, f1, h),
                init_method,
                ep_rank,
                etp_rank,
                etp_size,
                1,
                2 if gated else 1,
            )
            _init_stacked(
                self.linear_fc2.weight,
                (e, h, ffn),
                output_layer_init_method or init_method,
                ep_rank,
                etp_rank,
                etp_size,
                2,
                1,
            )

    def _check(self, x: torch.Tensor, tokens_per_expert: list[int]) -> None:
        if len(tokens_per_expert) != self.num_local_experts or sum(tokens_per_expert) != x.size(0):
            raise ValueError(
                f"tokens_per_expert={list(tokens_per_expert)} for {x.size(0)} rows and "
                f"{self.num_local_experts} local experts; the rule: one count per local "
                "expert, summing to the rows; fix: pass the dispatcher's counts"
            )

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        return mlp_activation(self.config, h)

    def activation_then(self, h: torch.Tensor, fc2: Any) -> torch.Tensor:
        """`fc2(activation(h))`; with "moe_act" recompute the activation's output is freed
        once fc2 has run and recomputed from `h` in backward."""
        if not recompute_now(self.config, "moe_act", self.training):
            return fc2(self.activation(h))
        ckpt = CheckpointWithoutOutput()
        out = fc2(ckpt.checkpoint(self.activation, h))
        ckpt.discard_output_and_register_recompute(out)
        return out

    def fc2_bias(self) -> torch.Tensor | None:
        """fc2's bias on etp rank 0 only (the etp shards of fc2's output are summed later)."""
        b = self.linear_fc2.bias
        return None if b is None or self.etp_rank != 0 else b

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """`[N, h]` expert-major -> `[N, h]`: per expert fc1, the activation, fc2 (each
        linear one `experts_linear` over all local experts; the activation is row-wise)."""
        self._check(x, tokens_per_expert)
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        counts = list(tokens_per_expert)
        h = experts_linear(x, fc1.weight, fc1.bias, counts)
        fc2_bias = self.fc2_bias()
        return self.activation_then(h, lambda a: experts_linear(a, fc2.weight, fc2_bias, counts))


_GROUPED_MM_OK: dict[tuple[str, int | None, torch.dtype], bool] = {}


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """One tiny `_grouped_mm` forward and backward on (device, dtype); False if it raises.

    Grad mode is forced on: the first call may come from an eval or no_grad pass.
    """
    try:
        with torch.inference_mode(False), torch.enable_grad():
            return _grouped_mm_round_trip(device, dtype)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False


def _grouped_mm_round_trip(device: torch.device, dtype: torch.dtype) -> bool:
    x = torch.ones(3, 16, device=device, dtype=dtype, requires_grad=True)
    w = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
    offs = torch.tensor([1, 3], device=device, dtype=torch.int32)
    y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    y.backward(torch.ones_like(y))
    return True


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Does torch._grouped_mm run forward and backward on x's device and dtype?

    Probed once per (device, dtype) and cached: the kernels' coverage changes between torch
    builds (CUDA bf16 on SM90+; CPU fp32/bf16 in recent ones), so asking is more reliable
    than a version table. The probe launches kernels: the first call belongs in an eager
    (warm-up) pass, not inside a CUDA-graph capture.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    key = (x.device.type, x.device.index, x.dtype)
    if key not in _GROUPED_MM_OK:
        _GROUPED_MM_OK[key] = _probe_grouped_mm(x.device, x.dtype)
    return _GROUPED_MM_OK[key]


class GroupedMLP(SequentialMLP):
    """Same parameters as SequentialMLP; one grouped GEMM per linear when supported."""

    def use_grouped_mm(self, x: torch.Tensor) -> bool:
        """torch runs it here, and every row stride is a multiple of 16 bytes (the kernel's
        rule: the fc1/fc2 in and out sizes times the element size)."""
        fc1, fc2 = self.linear_fc1.weight, self.linear_fc2.weight
        if x.size(0) == 0 or x.dtype != fc1.dtype or not grouped_mm_supported(x):
            return False
        dims = (*fc1.shape[1:], *fc2.shape[1:])
        return all(d * x.element_size() % 16 == 0 for d in dims)

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """`[N, h]` expert-major -> `[N, h]` (the loop where `use_grouped_mm` is False)."""
        self._check(x, tokens_per_expert)
        if not self.use_grouped_mm(x):
            return super().forward(x, tokens_per_expert)
        counts = torch.tensor(list(tokens_per_expert), device=x.device)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        sizes = list(tokens_per_expert)
        h = experts_linear(x.contiguous(), fc1.weight, None, sizes, offs)
        if fc1.bias is not None:
            h = experts_bias(h, fc1.bias, counts)
        out = self.activation_then(
            h, lambda a: experts_linear(a.contiguous(), fc2.weight, None, sizes, offs)
        )
        if fc2.bias is not None and self.etp_rank == 0:
            out = experts_bias(out, fc2.bias, counts)
        return out
