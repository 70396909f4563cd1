"""--compile: torch.compile each transformer layer in place (torchtitan's per-layer compile).

`compile_layers(model, backend)` calls `layer.compile(backend=...)` on every
`model.decoder.layers[i]` of a chunk, after the chunk is built and initialised and before
DDP wraps it (training/setup.get_model). `nn.Module.compile` keeps the module itself: its
identity, parameter objects, state-dict keys and hooks are unchanged (DDP's grad hooks,
checkpoints and Hugging Face conversion see the eager model), only its `__call__` runs
through Dynamo. The embedding, the output layer and the loss stay eager.

One compiled code serves every layer: the layers share one class and their parameters
are inputs of the graph, not constants, so Dynamo compiles the first layer and reuses that
for the others. It re-specialises (once, not per layer) for eval, for recomputation's
no-grad forward and, on the first pipeline stage, for the embedding's `[s, b, 1, d]` rotary
tables (later chunks get `[s, 1, 1, d]`): at most 4 versions, below Dynamo's limit of 8
per code (`torch._dynamo.config.cache_size_limit`, past which a layer silently runs
eagerly), which we therefore leave alone.

What the packages do under Dynamo (`torch.compiler.is_compiling()`), so that a layer is
one graph with no breaks at every tensor-parallel size, with or without sequence
parallelism:
- tp-layers' linears accumulate the weight gradient into `weight.main_grad` through one
  operator of the traced backward (`weight_grad_into_main_grad`, opaque to the compiler:
  a traced backward can neither write a tensor outside its graph nor set DDP's flag), with
  eager's kernel, so `main_grad` is eager's, in fp32 under --bf16;
- `parallel_state.comm` issues an `async_op=True` collective synchronously and returns a
  completed handle: Dynamo traces only synchronous collectives (as functional collectives,
  whose waits the compiler places), and the linears' backward overlap is the compiler's;
- the MLP's fused SwiGLU function gives way to its autograd form (same gradients; the
  compiler chooses what to keep for backward).
- with --overlap-param-gather, DDP waits for all of a chunk's params before the chunk runs
  (its per-module waits would run traced, where a wait is a graph break).
What composes and what `validate_args` refuses: docs/architecture.md.
"""

from __future__ import annotations

from typing import Any

import torch

BACKENDS = ("inductor", "aot_eager", "eager")
DEFAULT_BACKEND = "inductor"


def compile_layers(model: Any, backend: str = DEFAULT_BACKEND) -> int:
    """Compile every transformer layer of GPT chunk `model` (a GPTModel) in place; return
    how many.

    `backend`: "inductor" (generated kernels, the default), "aot_eager" (Dynamo and
    AOTAutograd without code generation: the same graphs, for debugging and CPU tests) or
    "eager" (Dynamo only).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: one of {BACKENDS}")
    layers = list(model.decoder.layers)
    for layer in layers:
        layer.compile(backend=backend)
    return len(layers)


def is_compiled(layer: torch.nn.Module) -> bool:
    """Whether `layer.compile()` was applied (its calls go through Dynamo)."""
    return getattr(layer, "_compiled_call_impl", None) is not None
