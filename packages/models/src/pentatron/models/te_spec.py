"""The transformer-engine layer spec, used only when transformer-engine is importable.

This is the package's one switch for TE (`HAVE_TE`). Without TE, `te_layer_spec` raises
`ModelConfigError` with the install command; the local spec has the same numerics in
PyTorch. With TE the spec swaps:
- the norms for TE's fused LayerNorm/RMSNorm;
- the GEMMs for TE's Linear through tp-layers' backend switch (`column_parallel_linear` /
  `row_parallel_linear(backend="te")`), which keeps tp-layers' initialisation and parameter
  attributes. SwiGLU's fc1 at tp > 1 stays on tp-layers' linear: its weight is split with
  stride 2 ([gate_r, up_r] per rank) and TE splits the output dim contiguously;
- core attention for TE's DotProductAttention (causal, GQA through `num_gqa_groups`);
and runs each layer under `fp8_autocast` when `config.fp8` is set. Parameter names stay
the local spec's (`weight`, `bias`), so checkpoints and HF conversion work with both.
This path runs only on CUDA with TE: `tools/device_checks/models_te.py` compares it with
the local spec there; CI checks only the fallback and the errors.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from pentatron.tp_layers import (
    ColumnParallelLinear,
    column_parallel_linear,
    divide,
    get_rng_tracker,
    row_parallel_linear,
)

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
    """The local spec with TE norms, linears and core attention, in an FP8-autocast layer."""
    require_te()
    from .layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm)
    layer = spec.submodules
    attn = layer.self_attention.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = TENorm
    if qk_layernorm:
        attn.q_layernorm = attn.k_layernorm = TENorm
    attn.linear_qkv = TEColumnParallelLinear
    attn.linear_proj = TERowParallelLinear
    attn.core_attention = TEDotProductAttention
    mlp = layer.mlp.submodules
    mlp.linear_fc1 = TEColumnParallelLinear
    mlp.linear_fc2 = TERowParallelLinear
    spec.module = FP8TransformerLayer
    return spec


def _tp_size(tp_group: Any) -> int:
    if tp_group is None:
        from pentatron.parallel_state import get_default_grid, model_parallel_is_initialized

        return get_default_grid().size("tp") if model_parallel_is_initialized() else 1
    return torch.distributed.get_world_size(tp_group)


def TEColumnParallelLinear(input_size: int, output_size: int, **kwargs: Any) -> Any:
    """TE's column-parallel Linear; a strided (fused [gate, up]) weight at tp > 1 stays on
    tp-layers' ColumnParallelLinear, whose split TE cannot express."""
    if kwargs.get("stride", 1) > 1 and _tp_size(kwargs.get("tp_group")) > 1:
        return ColumnParallelLinear(input_size, output_size, **kwargs)
    return column_parallel_linear(input_size, output_size, backend="te", **kwargs)


def TERowParallelLinear(input_size: int, output_size: int, **kwargs: Any) -> Any:
    """TE's row-parallel Linear (input split over tp; all-reduce or SP reduce-scatter)."""
    return row_parallel_linear(input_size, output_size, backend="te", **kwargs)


class TEDotProductAttention(torch.nn.Module):
    """TE's fused causal attention with the local DotProductAttention's interface.

    q `[s, b, nq/t, d]`, k/v `[s, b, ng/t, d]` -> `[s, b, nq d / t]`; GQA without repeating
    k/v (`num_gqa_groups`). `attention_mask` must be None (causal): TE's padding masks take
    another layout, so a custom mask raises instead of silently differing.
    """

    def __init__(self, config: Any, layer_number: int, tp_size: int) -> None:
        super().__init__()
        require_te("TEDotProductAttention")
        self.config = config
        heads = divide(config.num_attention_heads, tp_size, "num_attention_heads")
        groups = divide(config.num_query_groups, tp_size, "num_query_groups")
        self.attn = te.DotProductAttention(
            num_attention_heads=heads,
            kv_channels=config.kv_channels,
            num_gqa_groups=groups,
            attention_dropout=config.attention_dropout,
            attn_mask_type="causal",
            qkv_format="sbhd",
            layer_number=layer_number,
            softmax_scale=1.0 / (config.kv_channels**0.5),
        )

    def forward(self, q, k, v, attention_mask: Any = None) -> torch.Tensor:
        if attention_mask is not None:
            raise ModelConfigError(
                "attention_mask with TEDotProductAttention: the rule: the TE spec runs causal "
                "attention only; fix: pass attention_mask=None or use get_gpt_layer_local_spec()"
            )
        s, b = q.shape[:2]
        if self.config.attention_dropout and not self.config.sequence_parallel:
            with get_rng_tracker().fork():
                out = self.attn(q, k, v)
        else:
            out = self.attn(q, k, v)
        return out.reshape(s, b, -1)


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


def fp8_context(config: Any, amax_group: Any = None) -> Any:
    """`te.fp8_autocast` with Megatron's recipe when `config.fp8` is set, else nothing.

    `amax_group`: where the FP8 amax history is reduced, Megatron's amax-reduction group
    tp x dp x cp (the ranks of one pipeline stage that hold copies or shards of the same
    tensors); None reduces over the whole world, which would mix the stages' layers."""
    if config.fp8 is None:
        return contextlib.nullcontext()
    require_te("config.fp8")
    from transformer_engine.common import recipe  # type: ignore[import-not-found]

    fmt = recipe.Format.E4M3 if config.fp8 == "e4m3" else recipe.Format.HYBRID
    return te.fp8_autocast(
        enabled=True, fp8_recipe=recipe.DelayedScaling(fp8_format=fmt), fp8_group=amax_group
    )


def amax_reduction_group(parallel: Any) -> Any:
    """The tp-dp-cp group of a `ModelParallel` (None for one process)."""
    grid = getattr(parallel, "grid", None)
    return None if grid is None else grid.group("tp-dp-cp")


def _fp8_layer_class() -> Any:
    from .transformer_layer import TransformerLayer

    class _FP8TransformerLayer(TransformerLayer):
        """TransformerLayer run under `fp8_context(config, its amax-reduction group)`."""

        def forward(self, hidden: torch.Tensor, attention_mask: Any = None, rotary: Any = None):
            with fp8_context(self.config, amax_reduction_group(self.parallel)):
                return super().forward(hidden, attention_mask, rotary)

    return _FP8TransformerLayer


_FP8_LAYER: Any = None


def FP8TransformerLayer(*args: Any, **kwargs: Any) -> Any:
    """A TransformerLayer under FP8 autocast; the class is made once, on first use (it
    subclasses TransformerLayer, which imports this module)."""
    global _FP8_LAYER
    if _FP8_LAYER is None:
        _FP8_LAYER = _fp8_layer_class()
    return _FP8_LAYER(*args, **kwargs)
