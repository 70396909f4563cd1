"""`ModuleSpec` + `build_module`: which class builds each part of a layer, swappable per spec.

A spec names a module class (or a factory) plus fixed keyword arguments and, for composite
modules, the specs of its parts (`submodules`). `build_module(spec, *args, **kwargs)` calls
`spec.module(*args, **spec.params, **kwargs)` and passes `submodules=` when the spec has
them, so the local (PyTorch + tp-layers) and transformer-engine implementations are chosen
without touching the model code (Megatron's design).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModuleSpec:
    """`module`: a class or callable; `params`: fixed kwargs; `submodules`: specs of parts."""

    module: Any
    params: dict[str, Any] = field(default_factory=dict)
    submodules: Any = None


def build_module(spec: Any, *args: Any, **kwargs: Any) -> Any:
    """Build `spec` (a ModuleSpec, a class, or None -> None) with extra arguments.

    `kwargs` override `spec.params`. A spec with `submodules` passes them as `submodules=`.
    """
    if spec is None:
        return None
    if not isinstance(spec, ModuleSpec):
        return spec(*args, **kwargs)
    if not callable(spec.module):
        raise TypeError(
            f"ModuleSpec.module={spec.module!r} is not callable; the rule: a spec names a "
            "class or factory; fix: put the class itself in the spec"
        )
    params = {**spec.params, **kwargs}
    if spec.submodules is not None:
        params["submodules"] = spec.submodules
    return spec.module(*args, **params)


def build_linear(spec: Any, config: Any, input_size: int, output_size: int, **kwargs: Any) -> Any:
    """Build a layer's linear from `spec`; a module that normalises its own input (marked
    `fuses_input_norm`, the TE spec's fused norm+linear) also gets `config=`, from which it
    takes the norm's type and epsilon. Every linear gets `config.gradient_accumulation_fusion`
    (whether its weight grad goes straight into `main_grad`)."""
    module = spec.module if isinstance(spec, ModuleSpec) else spec
    kwargs.setdefault("gradient_accumulation_fusion", config.gradient_accumulation_fusion)
    if getattr(module, "fuses_input_norm", False):
        kwargs["config"] = config
    return build_module(spec, input_size, output_size, **kwargs)
