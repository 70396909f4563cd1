"""The transformer-engine layer spec, used only when transformer-engine is importable.

This is the package's one switch for TE (`HAVE_TE`). Without TE, `te_layer_spec` raises
`ModelConfigError` with the install command; the local spec has the same numerics in
PyTorch. With TE the spec swaps the norms for TE's fused LayerNorm/RMSNorm and runs each
layer under `fp8_autocast` when `config.fp8` is set; the GEMMs stay tp-layers' linears
(TE linear wrappers are future work), so the parameter names are the local spec's.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .config import ModelConfigError

try:  # pragma: no cover - depends on the environment
    import transformer_engine.pytorch as te  # type: ignore[import-not-found]

    HAVE_TE = True
except Exception:  # ImportError, or a broken CUDA install
    te = None
    HAVE_TE = False


def require_te(what: str = "get_gpt_layer_te_spec()") -> None:
    if not HAVE_TE:
        raise ModelConfigError(
            f"{what} needs transformer-engine, which is not importable here; the rule: the TE "
            "spec is used only when TE is installed; fix: pip install "
            "'pentatron-models[te]' on a CUDA machine, or use get_gpt_layer_local_spec()"
        )


def te_layer_spec(qk_layernorm: bool = True) -> Any:
    """The local spec with TE norms and an FP8-autocast layer (GEMMs: tp-layers linears)."""
    require_te()
    from .layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm)
    layer = spec.submodules
    attn = layer.self_attention.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = TENorm
    if qk_layernorm:
        attn.q_layernorm = attn.k_layernorm = TENorm
    spec.module = FP8TransformerLayer
    return spec


def TENorm(config: Any, hidden_size: int, eps: float | None = None, sequence_parallel=None) -> Any:
    """TE's fused LayerNorm / RMSNorm with the local Norm's arguments and attributes."""
    require_te("TENorm")
    cls = te.RMSNorm if config.normalization == "RMSNorm" else te.LayerNorm
    norm = cls(
        hidden_size,
        eps=config.layernorm_epsilon if eps is None else eps,
        params_dtype=config.params_dtype,
    )
    sp = config.sequence_parallel if sequence_parallel is None else sequence_parallel
    for p in norm.parameters():
        p.sequence_parallel = bool(sp)
    return norm


def fp8_context(config: Any) -> Any:
    """`te.fp8_autocast` with Megatron's recipe when `config.fp8` is set, else nothing."""
    if config.fp8 is None:
        return contextlib.nullcontext()
    require_te("config.fp8")
    from transformer_engine.common import recipe  # type: ignore[import-not-found]

    fmt = recipe.Format.E4M3 if config.fp8 == "e4m3" else recipe.Format.HYBRID
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling(fp8_format=fmt))


def _fp8_layer_class() -> Any:
    from .transformer_layer import TransformerLayer

    class _FP8TransformerLayer(TransformerLayer):
        """TransformerLayer run under `fp8_context(config)`."""

        def forward(self, hidden: torch.Tensor, attention_mask: Any = None, rotary: Any = None):
            with fp8_context(self.config):
                return super().forward(hidden, attention_mask, rotary)

    return _FP8TransformerLayer


def FP8TransformerLayer(*args: Any, **kwargs: Any) -> Any:
    return _fp8_layer_class()(*args, **kwargs)
