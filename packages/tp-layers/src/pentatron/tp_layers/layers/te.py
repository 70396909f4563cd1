"""Transformer-engine linears behind the tp-layers constructor arguments (optional, CUDA).

One switch picks the implementation: `linear_backend(backend)`, where `backend` is
"torch", "te" or "auto" (default: the PENTATRON_LINEAR_BACKEND environment variable, else
"auto"). "auto" means TE when `transformer_engine.pytorch` imports and CUDA is available,
else the PyTorch layers of this package, whose numerics TE's fp32/bf16 GEMMs match up to
kernel rounding. `column_parallel_linear(...)` / `row_parallel_linear(...)` /
`layer_norm_column_parallel_linear(...)` take exactly the arguments of
`ColumnParallelLinear` / `RowParallelLinear` / `LayerNormColumnParallelLinear` (TE's
`Linear` / `LayerNormLinear`), return `(output, bias)` from `forward` like them, and carry
the same parameter names and attributes (`tensor_model_parallel`, `partition_dim`,
`partition_stride`, `allreduce`, `sequence_parallel` on a row bias and on a fused norm's
parameters), so DDP, clipping and checkpoints treat both alike.

TE is imported only when a TE layer is asked for. Arguments TE cannot honour raise
`TPConfigError` naming the argument: `gather_output`, `skip_weight_param_allocation` (a
tied output layer), `is_expert`, `regather_input=False`. Weight-grad accumulation stays
with DDP's hook (TE's `fuse_wgrad_accumulation` needs `main_grad` on every weight, even
outside DDP), and initialisation is ours: the full master weight is drawn and split (with
`stride` fused blocks, e.g. SwiGLU's [gate_r, up_r]; TE's GEMM does not care how the rows
of a shard were chosen), so a TE layer at tp=t starts from the TP=1 weights too.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from ..norms import check_normalization
from ..utils import TPConfigError, group_size, set_tensor_model_parallel_attributes
from .column import ColumnParallelLinear
from .common import default_init, make_weight, resolve_layer_group
from .norm_linear import LayerNormColumnParallelLinear
from .row import RowParallelLinear

BACKENDS = ("auto", "torch", "te")
_UNSUPPORTED = {
    "gather_output": False,
    "skip_weight_param_allocation": False,
    "is_expert": False,
    "regather_input": True,
}


@functools.lru_cache(maxsize=1)
def _te() -> Any:
    try:
        import transformer_engine.pytorch as te  # type: ignore[import-not-found]
    except Exception:  # ImportError, or a TE build that does not match this CUDA
        return None
    return te


def te_available() -> bool:
    """transformer_engine.pytorch imports and a CUDA device is visible."""
    return torch.cuda.is_available() and _te() is not None


def linear_backend(backend: str | None = None) -> str:
    """ "te" or "torch" for `backend` (None: $PENTATRON_LINEAR_BACKEND, else "auto")."""
    chosen = backend or os.environ.get("PENTATRON_LINEAR_BACKEND") or "auto"
    if chosen not in BACKENDS:
        raise TPConfigError(
            f"linear backend {chosen!r}: the rule: one of {', '.join(BACKENDS)}; fix: pass "
            "backend='torch' or 'te', or unset PENTATRON_LINEAR_BACKEND"
        )
    if chosen == "auto":
        return "te" if te_available() else "torch"
    if chosen == "te" and not te_available():
        raise TPConfigError(
            "linear backend 'te' needs transformer-engine and CUDA, and this process has "
            f"{'no CUDA device' if not torch.cuda.is_available() else 'no transformer_engine'}; "
            "fix: pip install 'pentatron-tp-layers[te]' on a CUDA machine, or use 'torch'"
        )
    return chosen


def _check_supported(kind: str, kwargs: dict[str, Any]) -> None:
    for name, ok in _UNSUPPORTED.items():
        if name in kwargs and kwargs[name] != ok:
            raise TPConfigError(
                f"{kind}({name}={kwargs[name]!r}) with the transformer-engine backend: TE's "
                f"linear has no such mode; fix: use backend='torch' for this layer"
            )


def _mark(param: torch.nn.Parameter, tp: bool, dim: int, stride: int = 1) -> None:
    set_tensor_model_parallel_attributes(param, tp, dim, stride)
    param.allreduce = True  # type: ignore[attr-defined]  # torch stubs lack .allreduce


def _te_linear(
    kind: str, input_size: int, output_size: int, kwargs: dict[str, Any], **norm: Any
) -> torch.nn.Module:
    """TE's Linear (`norm` empty) or LayerNormLinear (`norm`: normalization, eps) for `kind`."""
    _check_supported(kind, kwargs)
    group = resolve_layer_group(kwargs.get("tp_group"), False)
    tp, stride = group_size(group), kwargs.get("stride", 1)
    column = kind != "RowParallelLinear"
    dtype = kwargs.get("params_dtype") or torch.get_default_dtype()
    sp = kwargs.get("sequence_parallel", False)
    layer = _te_class(bool(norm))(
        input_size,
        output_size,
        bias=kwargs.get("bias", True),
        sequence_parallel=sp,
        fuse_wgrad_accumulation=False,
        tp_group=group,
        tp_size=tp,
        return_bias=kwargs.get("skip_bias_add", False),
        parallel_mode="column" if column else "row",
        params_dtype=dtype,
        device=kwargs.get("device") or "cuda",
        **norm,
    )
    layer.pentatron_returns_bias = kwargs.get("skip_bias_add", False)
    dim = 0 if column else 1
    shard = tuple(layer.weight.shape)
    master = make_weight(
        shard,
        (output_size, input_size),
        dim,
        stride,
        default_init(kwargs.get("init_method")),
        group,
        dtype,
        layer.weight.device,
    )
    with torch.no_grad():
        layer.weight.copy_(master)
    _mark(layer.weight, True, dim, stride)
    bias = getattr(layer, "bias", None)
    if isinstance(bias, torch.nn.Parameter) and bias.numel():
        with torch.no_grad():
            bias.zero_()
        _mark(bias, column, 0, stride if column else 1)
        if not column:
            # torch stubs lack .sequence_parallel
            bias.sequence_parallel = sp  # type: ignore[attr-defined]
    for name in ("layer_norm_weight", "layer_norm_bias"):
        p = getattr(layer, name, None)
        if isinstance(p, torch.nn.Parameter):  # TE marks them only when tp > 1
            # torch stubs lack .sequence_parallel
            p.sequence_parallel = sp  # type: ignore[attr-defined]
    return layer


@functools.lru_cache(maxsize=2)
def _te_class(fused_norm: bool) -> type:
    """TE's Linear (or LayerNormLinear) with tp-layers' `forward(x) -> (y, bias | None)`
    (made on first use, so nothing imports TE before a TE layer is asked for)."""
    base: Any = _te().LayerNormLinear if fused_norm else _te().Linear

    class TEParallelLinear(base):
        # None: TE casts the weight to FP8 at every forward. A schedule call sets True
        # (pentatron.pipeline's weight_cache_window): the first forward casts and caches,
        # the following micro-batches of that call reuse the cached FP8 weight.
        is_first_microbatch: bool | None = None

        def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None):
            if weight is not None:
                raise TPConfigError(
                    "forward(weight=...) with the transformer-engine backend: TE layers own "
                    "their weight; fix: use backend='torch' for a tied output layer"
                )
            out = super().forward(x, is_first_microbatch=self.is_first_microbatch)
            if self.is_first_microbatch:
                self.is_first_microbatch = False
            return out if self.pentatron_returns_bias else (out, None)

    return TEParallelLinear


def column_parallel_linear(
    input_size: int, output_size: int, *, backend: str | None = None, **kwargs: Any
) -> torch.nn.Module:
    """`ColumnParallelLinear(input_size, output_size, **kwargs)` on the chosen backend."""
    if linear_backend(backend) == "torch":
        return ColumnParallelLinear(input_size, output_size, **kwargs)
    return _te_linear("ColumnParallelLinear", input_size, output_size, kwargs)


def row_parallel_linear(
    input_size: int, output_size: int, *, backend: str | None = None, **kwargs: Any
) -> torch.nn.Module:
    """`RowParallelLinear(input_size, output_size, **kwargs)` on the chosen backend."""
    if linear_backend(backend) == "torch":
        return RowParallelLinear(input_size, output_size, **kwargs)
    return _te_linear("RowParallelLinear", input_size, output_size, kwargs)


def layer_norm_column_parallel_linear(
    input_size: int,
    output_size: int,
    *,
    normalization: str = "LayerNorm",
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    backend: str | None = None,
    **kwargs: Any,
) -> torch.nn.Module:
    """`LayerNormColumnParallelLinear(...)` on the chosen backend (TE: `LayerNormLinear`,
    whose `zero_centered_gamma` has the same meaning)."""
    if linear_backend(backend) == "torch":
        return LayerNormColumnParallelLinear(
            input_size,
            output_size,
            normalization=normalization,
            eps=eps,
            zero_centered_gamma=zero_centered_gamma,
            **kwargs,
        )
    check_normalization(normalization)  # TE only asserts
    return _te_linear(
        "LayerNormColumnParallelLinear",
        input_size,
        output_size,
        kwargs,
        normalization=normalization,
        eps=eps,
        zero_centered_gamma=zero_centered_gamma,
    )
