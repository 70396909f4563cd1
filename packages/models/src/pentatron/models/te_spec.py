"""The transformer-engine layer spec, and its PyTorch twin.

`te_layer_spec(qk_layernorm, backend)` builds Megatron's TE layout:
- the norm before attention and before a dense MLP is fused into the linear after it
  (`TELayerNormColumnParallelLinear`: TE's `LayerNormLinear`), so `input_layernorm` and
  `pre_mlp_layernorm` are identities and the parameters are named
  `self_attention.linear_qkv.layer_norm_weight` and `mlp.linear_fc1.layer_norm_weight`
  (+ `layer_norm_bias` for LayerNorm), as in Megatron. A MoE layer keeps its own
  `pre_mlp_layernorm` (its router and experts read the normed input);
- the other GEMMs are TE Linears through tp-layers' backend switch, which keeps
  tp-layers' initialisation, strided splits (SwiGLU's [gate_r, up_r]) and parameter
  attributes; q/k norms are TE norms; core attention is TE's DotProductAttention (causal,
  GQA through `num_gqa_groups`);
- each layer runs under `fp8_autocast` when `config.fp8` is set.

`backend="te"` (the default) needs TE and CUDA: without them `te_layer_spec` raises
`ModelConfigError` with the install command. `backend="torch"` builds the same layout and
parameter names from PyTorch modules with the local spec's numerics (tp-layers'
`LayerNormColumnParallelLinear`, local attention and norms; FP8 is refused): it runs
anywhere, loads a TE-spec state dict, and is how CI tests the layout.

`global_param_name` maps the fused names to the local spec's (`input_layernorm.weight`,
`pre_mlp_layernorm.weight`), so checkpoints and Hugging Face conversion are shared by both
specs, and `TransformerLayer` loads a state dict of either layout. The TE modules run only
on CUDA: `tools/device_checks/models_te.py` compares them with the local spec there.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from pentatron.tp_layers import (
    column_parallel_linear,
    divide,
    get_rng_tracker,
    layer_norm_column_parallel_linear,
    row_parallel_linear,
)

from .config import ModelConfigError
from .spec import ModuleSpec

TE_SPEC_BACKENDS = ("te", "torch")

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


def te_layer_spec(qk_layernorm: bool = True, backend: str = "te") -> Any:
    """The TE layout (fused norm+linear, FP8-autocast layer) on `backend` "te" or "torch"."""
    from .attention import DotProductAttention
    from .layer_specs import get_gpt_layer_local_spec
    from .norm import Norm
    from .transformer_layer import TransformerLayer

    if backend not in TE_SPEC_BACKENDS:
        raise ModelConfigError(
            f"get_gpt_layer_te_spec(backend={backend!r}): the rule: one of "
            f"{', '.join(TE_SPEC_BACKENDS)}; fix: 'te' on a CUDA machine with "
            "transformer-engine, 'torch' for the same layout in PyTorch"
        )
    te_modules = backend == "te"
    if te_modules:
        require_te()
    spec = get_gpt_layer_local_spec(qk_layernorm)
    layer = spec.submodules
    attn = layer.self_attention.submodules
    mlp = layer.mlp.submodules
    norm = TENorm if te_modules else Norm
    fused = ModuleSpec(module=TELayerNormColumnParallelLinear, params={"backend": backend})
    row = ModuleSpec(module=TERowParallelLinear, params={"backend": backend})
    layer.input_layernorm = layer.pre_mlp_layernorm = torch.nn.Identity
    layer.moe_pre_mlp_layernorm = norm
    if qk_layernorm:
        attn.q_layernorm = attn.k_layernorm = norm
    attn.linear_qkv, attn.linear_proj = fused, row
    attn.core_attention = TEDotProductAttention if te_modules else DotProductAttention
    mlp.linear_fc1, mlp.linear_fc2 = fused, row
    spec.module = FP8TransformerLayer if te_modules else TransformerLayer
    return spec


def TELayerNormColumnParallelLinear(
    input_size: int, output_size: int, *, config: Any, backend: str = "te", **kwargs: Any
) -> Any:
    """`config.normalization` fused into a column-parallel linear: TE's LayerNormLinear, or
    tp-layers' `LayerNormColumnParallelLinear` (same names and numbers) for "torch"."""
    return layer_norm_column_parallel_linear(
        input_size,
        output_size,
        normalization=config.normalization,
        eps=config.layernorm_epsilon,
        zero_centered_gamma=config.layernorm_zero_centered_gamma,
        backend=backend,
        **kwargs,
    )


TELayerNormColumnParallelLinear.fuses_input_norm = True  # type: ignore[attr-defined]


def TEColumnParallelLinear(input_size: int, output_size: int, **kwargs: Any) -> Any:
    """TE's column-parallel Linear (`backend=` "te" default, or "torch")."""
    kwargs.setdefault("backend", "te")
    return column_parallel_linear(input_size, output_size, **kwargs)


def TERowParallelLinear(input_size: int, output_size: int, **kwargs: Any) -> Any:
    """TE's row-parallel Linear (input split over tp; all-reduce or SP reduce-scatter)."""
    kwargs.setdefault("backend", "te")
    return row_parallel_linear(input_size, output_size, **kwargs)


_TE_ATTENTION_ENV = {  # (NVTE_FLASH_ATTN, NVTE_FUSED_ATTN, NVTE_UNFUSED_ATTN), Megatron's
    "auto": ("1", "1", "1"),
    "flash": ("1", "0", "0"),
    "fused": ("0", "1", "0"),
    "unfused": ("0", "0", "1"),
}


def te_attention_env(attention_backend: str) -> dict[str, str]:
    """The NVTE_* switches Megatron sets for `attention_backend` (its
    `LanguageModule._set_attention_backend`); "local" is PyTorch's attention, not TE's."""
    if attention_backend not in _TE_ATTENTION_ENV:
        raise ModelConfigError(
            f"attention_backend={attention_backend!r} with TEDotProductAttention: the rule: "
            "'local' is the PyTorch attention, which the TE spec does not run; fix: "
            "get_gpt_layer_local_spec() or get_gpt_layer_te_spec(backend='torch'), or "
            f"one of {sorted(_TE_ATTENTION_ENV)}"
        )
    names = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
    return dict(zip(names, _TE_ATTENTION_ENV[attention_backend]))


def set_te_attention_env(attention_backend: str) -> None:
    """Set the NVTE_* switches for `attention_backend`; one the user set otherwise raises
    (as Megatron's check)."""
    import os

    for name, value in te_attention_env(attention_backend).items():
        current = os.environ.get(name)
        if current is not None and current != value:
            raise ModelConfigError(
                f"{name}={current} in the environment with attention_backend="
                f"{attention_backend!r}: the rule: the backend sets {name}={value}; fix: unset "
                "NVTE_FLASH_ATTN, NVTE_FUSED_ATTN and NVTE_UNFUSED_ATTN and choose with "
                "attention_backend"
            )
        os.environ[name] = value


class TEDotProductAttention(torch.nn.Module):
    """TE's fused causal attention with the local DotProductAttention's interface.

    q `[s, b, nq/t, d]`, k/v `[s, b, ng/t, d]` -> `[s, b, nq d / t]`; GQA without repeating
    k/v (`num_gqa_groups`). `attention_mask` must be None (causal): TE's padding masks take
    another layout, so a custom mask raises instead of silently differing.
    `config.attention_backend` picks TE's kernels through NVTE_* (`set_te_attention_env`).
    """

    def __init__(
        self, config: Any, layer_number: int, tp_size: int, tp_group: Any = None, **_: Any
    ) -> None:
        super().__init__()
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise ModelConfigError(
                f"softmax_type={config.softmax_type!r}, window_size={config.window_size}: the "
                "rule: the transformer-engine attention is wired for plain causal softmax; "
                "fix: the local spec (app: --transformer-impl local)"
            )
        require_te("TEDotProductAttention")
        set_te_attention_env(config.attention_backend)
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
        zero_centered_gamma=config.layernorm_zero_centered_gamma,
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
    fp8_recipe = recipe.DelayedScaling(fp8_format=fmt, **fp8_recipe_kwargs(config))
    return te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe, fp8_group=amax_group)


def fp8_recipe_kwargs(config: Any) -> dict[str, Any]:
    """The DelayedScaling arguments Megatron's recipe takes from its config: the scale's
    margin (a power of two of headroom) and the amax history (its length, and whether the
    scale follows the newest amax or the history's maximum)."""
    return {
        "margin": config.fp8_margin,
        "amax_history_len": config.fp8_amax_history_len,
        "amax_compute_algo": config.fp8_amax_compute_algo,
    }


def amax_reduction_group(parallel: Any) -> Any:
    """The tp-dp-cp group of a `ModelParallel` (None for one process)."""
    grid = getattr(parallel, "grid", None)
    return None if grid is None else grid.group("tp-dp-cp")


def _fp8_layer_class() -> Any:
    from .transformer_layer import TransformerLayer

    class _FP8TransformerLayer(TransformerLayer):
        """TransformerLayer run under `fp8_context(config, its amax-reduction group)`."""

        runs_fp8 = True

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
