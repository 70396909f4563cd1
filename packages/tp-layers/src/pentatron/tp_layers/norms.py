"""LayerNorm and RMSNorm as functions, computed in fp32 and returned in the weight's dtype.

One definition serves the fused norm+linear layer here and pentatron.models' norm modules,
so a norm fused into a linear has the numbers of the separate norm it replaces. Shapes are
unchanged over the last dim `h`: `[s, b, h]` (or `[s/t, b, h]` with sequence parallelism).

Each is one autograd function, as Megatron's fused norm kernels are: it keeps for backward
only its input `x` in its own dtype, the per-row fp32 statistics (`[s, b, 1]`: rstd, and
the mean for LayerNorm) and the parameters. Written in plain autograd, a 16-bit `x` would leave
its fp32 copy `4 sbh` (and for RMSNorm the 16-bit normalised tensor) alive until backward;
here backward recomputes the fp32 normalised input from `x` and the statistics, a transient.
The forward is the plain-autograd formula op for op, so outputs are bitwise unchanged.
Double backward is out of scope: a backward run with `create_graph=True` raises.

Inside a zero-bubble schedule's B (`WeightGradStore.defer()`) backward returns only the
input gradient and queues the weight (and bias) gradient as part of the micro-batch's W,
holding `x`, the statistics and the output gradient; the W computes it with the same
formula (LayerNorm: the same kernel), so the numbers are those of an undivided backward.

`zero_centered_gamma=True` (Megatron's `layernorm_zero_centered_gamma`, `--apply-layernorm-1p`;
transformer-engine's `zero_centered_gamma`): the stored weight `w` is zero-centred and the
norm scales by `1 + w`, formed in fp32 (as TE's kernels): RMSNorm returns
`(n * (1 + w)).to(w.dtype)`, LayerNorm `layer_norm(x, 1 + w, b)`. The grad of `w` is that of
the effective gamma `1 + w`. Modules holding such a weight initialise it to 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .utils import TPConfigError

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(normalization: str) -> None:
    """Raise `TPConfigError` unless `normalization` is one of `NORMALIZATIONS`."""
    if normalization not in NORMALIZATIONS:
        raise TPConfigError(
            f"normalization={normalization!r}: the rule: one of {', '.join(NORMALIZATIONS)}; "
            "fix: pass normalization='LayerNorm' or 'RMSNorm'"
        )


def _row_sum(t: torch.Tensor) -> torch.Tensor:
    """`[.., h]` -> `[h]`: the sum over every dim but the last (a weight's grad)."""
    return t.reshape(-1, t.shape[-1]).sum(0)


def _refuse_double_backward(name: str) -> None:
    """Raise inside a backward that autograd records (`create_graph=True`): the hand-written
    backward is not itself differentiable, and `once_differentiable` would only fail later,
    or not at all when the upstream grad is a constant."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{name}: double backward (create_graph=True) is not supported: the rule: its "
            "backward is hand-written and not differentiable; fix: differentiate the plain "
            "formula (torch.nn.functional) for higher-order gradients"
        )


def _defer(weight_grads: Callable[[], list], held: tuple[torch.Tensor, ...]) -> bool:
    """Inside a zero-bubble schedule's B (`WeightGradStore.defer()`): queue `weight_grads`
    (its (param, grad) pairs) as part of the micro-batch's W, keeping `held`; True if
    queued, False outside a B (compute them now)."""
    # Imported here: the layers package imports this module (the fused norm + linear).
    from .layers.weight_grad_store import DeferredWeightGrad, deferring_store

    store = deferring_store()
    if store is None:
        return False
    store.push(DeferredWeightGrad(weight_grads, sum(t.numel() * t.element_size() for t in held)))
    return True


def _gamma(weight: torch.Tensor, zero_centered: bool) -> torch.Tensor:
    """The fp32 scale a norm applies: `1 + weight` when zero-centred, else `weight`."""
    return weight.float() + 1.0 if zero_centered else weight.float()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
    ) -> torch.Tensor:
        h = x.to(torch.float32)
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        ctx.zero_centered = zero_centered
        if zero_centered:  # TE's order: the scale in fp32, one cast at the end
            return ((h * rstd) * _gamma(weight, True)).to(weight.dtype)
        return weight * (h * rstd).to(weight.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _refuse_double_backward("rms_norm")
        x, rstd, weight = ctx.saved_tensors
        n = x.to(torch.float32) * rstd  # the fp32 normalised input, recomputed
        g = grad.to(torch.float32)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dn = g * _gamma(weight, ctx.zero_centered)
            # d/dx of x * rstd(x): rstd * (dn - n * mean(dn * n)) over the last dim
            dx = (rstd * (dn - n * (dn * n).mean(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:

            def weight_grad() -> torch.Tensor:  # from x, rstd and grad (a deferred W's hold)
                n = x.to(torch.float32) * rstd
                return _row_sum(grad.to(torch.float32) * n).to(weight.dtype)

            if not _defer(lambda: [(weight, weight_grad())], (x, rstd, grad)):
                dw = weight_grad()
        return dx, dw, None, None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        eps: float,
        zero_centered: bool,
    ) -> torch.Tensor:
        # F.layer_norm's own kernel, which also returns the fp32 mean and rstd `[.., 1]`
        out, mean, rstd = torch.native_layer_norm(
            x.to(torch.float32),
            (weight.numel(),),
            _gamma(weight, zero_centered),
            bias.float(),
            eps,
        )
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        ctx.zero_centered = zero_centered
        return out.to(weight.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        _refuse_double_backward("layer_norm")
        x, mean, rstd, weight, bias = ctx.saved_tensors
        zero_centered = ctx.zero_centered
        mask = list(ctx.needs_input_grad[:3])

        def kernel(mask: list[bool]) -> tuple:
            return torch.ops.aten.native_layer_norm_backward(
                grad.to(torch.float32),
                x.to(torch.float32),
                (weight.numel(),),
                mean,
                rstd,
                _gamma(weight, zero_centered),
                bias.float(),  # unused, but the kernel shapes dbias after it
                mask,
            )

        want_w, want_b = mask[1], mask[2]

        def weight_grads() -> list:  # a deferred W: dw and db from the same kernel
            _, dw, db = kernel([False, want_w, want_b])
            pairs = ((weight, dw, want_w), (bias, db, want_b))
            return [(p, g.to(p.dtype)) for p, g, wanted in pairs if wanted]

        if (want_w or want_b) and _defer(weight_grads, (x, mean, rstd, grad)):
            mask = [mask[0], False, False]
        dx, dw, db = kernel(mask)
        dx = dx.to(x.dtype) if mask[0] else None
        dw = dw.to(weight.dtype) if mask[1] else None
        db = db.to(bias.dtype) if mask[2] else None
        return dx, dw, db, None, None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool = False
) -> torch.Tensor:
    """`x / sqrt(mean(x^2) + eps) * weight` (Hugging Face Llama's order of casts):
    `[.., h]` -> `[.., h]` in `weight`'s dtype, keeping `x` and the fp32 rstd `[.., 1]`.
    `zero_centered_gamma`: scale by `1 + weight` (see the module docstring)."""
    return _RMSNorm.apply(x, weight, eps, zero_centered_gamma)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    zero_centered_gamma: bool = False,
) -> torch.Tensor:
    """`torch.nn.functional.layer_norm` with weight and bias, computed in fp32: `[.., h]` ->
    `[.., h]` in `weight`'s dtype, keeping `x` and the fp32 mean and rstd `[.., 1]`.
    `zero_centered_gamma`: scale by `1 + weight` (see the module docstring)."""
    return _LayerNorm.apply(x, weight, bias, eps, zero_centered_gamma)
