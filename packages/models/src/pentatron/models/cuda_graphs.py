"""CUDA graphs of the transformer layers (`enable_cuda_graph`, Megatron's `--enable-cuda-graph`).

Each transformer layer gets one forward graph and one backward graph per micro-batch
position of a training step (the k-th call of layer L in a step replays runner (L, k)), so
the micro-batches a pipeline schedule keeps in flight never share static buffers. The
embedding, the final norm, the output layer and the loss stay eager.

    graphs = LayerCudaGraphs(chunks)   # attaches itself to each chunk's TransformerBlock
    for step ...:
        graphs.begin_step()            # after `warmup_steps` eager steps: capture, once
        ... forward_backward_func(...) ...

1. Warm-up steps run eagerly while `begin_step` / the layers record the order in which each
   runner's forward and backward ran (1F1B and the interleaved schedule mix them).
2. At the next `begin_step` every runner is captured, in that recorded order, into ONE
   memory pool: memory the pool gives a later capture was released by an earlier one, so
   with replays in the same order no graph overwrites memory another still needs.
3. Later steps replay: the inputs are copied into the runner's static inputs, the forward
   graph replays, and an autograd node replays the backward graph with the incoming grad,
   handing the static input and parameter grads to autograd (DDP's hooks then see them
   as usual; weight grads fused into `main_grad` by tp-layers are part of the graph).

Eval (no grad) and any call outside training run the layer eagerly. The graphs need fixed
shapes, no CPU synchronisation inside a layer and no RNG draws, so `TransformerConfig`
refuses enable_cuda_graph with dropout, MoE layers, context parallelism and activation
recomputation (see `check_cuda_graph`); the training app also refuses FSDP2, FP8 and a
batch-size ramp-up. CUDA only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from .transformer_block import TransformerBlock

Capture = Callable[[Callable[[], Any], Any], tuple[Any, Any]]  # (fn, pool) -> (graph, out)


class CudaGraphError(RuntimeError):
    """A step did not match the recorded one (e.g. another number of micro-batches)."""


def cuda_capture(fn: Callable[[], Any], pool: Any) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture `fn`'s CUDA work into a new graph that allocates from `pool`."""
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class EagerGraph:
    """What `eager_capture` returns: `replay()` runs the captured function again and writes
    its results into the tensors the capture returned, as a CUDA graph replay writes its
    static outputs. Counts its replays."""

    def __init__(self, fn: Callable[[], Any], outputs: Any) -> None:
        self.fn, self.outputs, self.replays = fn, outputs, 0

    def replay(self) -> None:
        with torch.enable_grad():  # a forward must rebuild the autograd graph backward walks
            new = self.fn()
        flat = lambda x: list(x) if isinstance(x, tuple) else [x]  # noqa: E731
        with torch.no_grad():
            for static, value in zip(flat(self.outputs), flat(new)):
                if static is not None:
                    static.copy_(value)
        self.replays += 1


def eager_capture(fn: Callable[[], Any], pool: Any) -> tuple[EagerGraph, Any]:
    """A capture function for any device: the graphs' bookkeeping (recorded order, one
    runner per micro-batch position, static buffers, the replayed backward) without CUDA.
    For debugging a graphed run on CPU and for the CPU tests; it saves no launch time."""
    out = fn()
    return EagerGraph(fn, out), out


def _tensors(mask: Any, rotary: Any) -> list[torch.Tensor | None]:
    cos, sin = rotary if rotary is not None else (None, None)
    return [mask if isinstance(mask, torch.Tensor) else None, cos, sin]


@dataclass(eq=False)
class LayerRunner:
    """Graphs of one layer for one micro-batch position: static inputs, outputs and grads.

    Static inputs: `hidden [s, b, h]` (SP: `[s/t, b, h]`), and the optional attention mask
    and RoPE cos/sin; `params` are the layer's trainable parameters (their storage never
    moves: the optimizer updates them in place).
    """

    layer: torch.nn.Module
    name: str
    sample: list[torch.Tensor | None] = field(default_factory=list)  # hidden, mask, cos, sin
    static_in: list[torch.Tensor | None] = field(default_factory=list)
    static_out: torch.Tensor | None = None
    static_grad_out: torch.Tensor | None = None
    static_grads: tuple[torch.Tensor | None, ...] = ()  # d hidden, then d params
    fwd_graph: Any = None
    bwd_graph: Any = None
    in_flight: bool = False  # forward replayed, backward not yet
    _live_out: torch.Tensor | None = None  # the output whose autograd graph backward walks
    params: list[torch.nn.Parameter] = field(init=False)  # fixed: read on every replay

    def __post_init__(self) -> None:
        self.params = [p for p in self.layer.parameters() if p.requires_grad]

    def record(self, hidden: torch.Tensor, others: list[torch.Tensor | None]) -> None:
        """Keep detached copies of this call's inputs as the capture's sample inputs."""
        self.sample = [hidden.detach().clone().requires_grad_(hidden.requires_grad)]
        self.sample += [None if t is None else t.detach().clone() for t in others]

    def _forward(self) -> torch.Tensor:
        hidden, mask, cos, sin = self.static_in
        self._live_out = self.layer(hidden, mask, None if cos is None else (cos, sin))
        return self._live_out

    def _backward(self) -> tuple[torch.Tensor | None, ...]:
        hidden, out = self.static_in[0], self._live_out
        assert hidden is not None, "record() always stores the hidden input first"
        assert out is not None, "a runner's backward always follows its forward"
        inputs = ([hidden] if hidden.requires_grad else []) + self.params
        grads = torch.autograd.grad(out, inputs, self.static_grad_out, allow_unused=True)
        self._live_out = None
        return ((None,) if not hidden.requires_grad else ()) + tuple(grads)

    def warm_up(self) -> None:
        """One eager forward and backward on a side stream (lazy library set-up), as torch
        requires before capture; its results, incl. any main_grad it touched, are discarded
        by the caller (a step starts by zeroing the grad buffers)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.static_in = list(self.sample)
            self.static_out = self._forward()
            self.static_grad_out = torch.ones_like(self.static_out)
            self._backward()
        torch.cuda.current_stream().wait_stream(stream)
        self.static_out = self.static_grad_out = self._live_out = None

    def capture_forward(self, capture: Capture, pool: Any) -> None:
        self.static_in = list(self.sample)
        self.fwd_graph, self.static_out = capture(self._forward, pool)

    def capture_backward(self, capture: Capture, pool: Any) -> None:
        assert self.static_out is not None, "the recorded order captures forward before backward"
        self.static_grad_out = torch.zeros_like(self.static_out)
        self.bwd_graph, self.static_grads = capture(self._backward, pool)

    @torch.no_grad()  # the static hidden is a leaf that requires grad
    def load_inputs(self, hidden: torch.Tensor, others: list[torch.Tensor | None]) -> None:
        for static, new in zip(self.static_in, [hidden, *others]):
            if (static is None) != (new is None):
                raise CudaGraphError(
                    f"{self.name}: an input was {'given' if new is not None else 'missing'} "
                    "that the captured step did not have"
                )
            if static is not None and new is not None:  # both or neither (checked above)
                if static.shape != new.shape:
                    raise CudaGraphError(
                        f"{self.name}: input shape {tuple(new.shape)} differs from the "
                        f"captured {tuple(static.shape)}; CUDA graphs need fixed shapes"
                    )
                static.copy_(new)


class _Replay(torch.autograd.Function):
    """Forward: replay the runner's forward graph; backward: its backward graph."""

    @staticmethod
    def forward(ctx: Any, runner: LayerRunner, last: bool, hidden, *rest) -> torch.Tensor:
        ctx.runner = runner
        runner.fwd_graph.replay()
        runner.in_flight = True
        out = runner.static_out
        assert out is not None, "only captured runners are replayed"
        # The last layer's output leaves the graphed region (final norm, p2p send and its
        # pseudo-free): hand out a copy so nothing outside can touch the static buffer.
        return out.clone() if last else out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        runner = ctx.runner
        runner.static_grad_out.copy_(grad)
        runner.bwd_graph.replay()
        runner.in_flight = False
        d_hidden, *d_params = runner.static_grads
        return (None, None, d_hidden, None, None, None, *d_params)  # runner, last, 4 inputs


class _RecordBackward(torch.autograd.Function):
    """Identity whose backward notes when the runner's backward ran (the capture order)."""

    @staticmethod
    def forward(ctx: Any, graphs: LayerCudaGraphs, runner: LayerRunner, out: torch.Tensor):
        ctx.graphs, ctx.runner = graphs, runner
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.graphs.order.append(("bwd", ctx.runner))
        return None, None, grad


class LayerCudaGraphs:
    """The CUDA graphs of every transformer layer of this rank's model chunks.

    `chunks`: GPTModel chunks (or wrappers with `.module`), in virtual-stage order; they all
    share one recorded order and one memory pool. `capture` is the capture function
    (`cuda_capture`; another only for tests of the bookkeeping).
    """

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        warmup_steps: int = 3,
        capture: Capture = cuda_capture,
    ) -> None:
        if warmup_steps < 1:
            raise ValueError(
                f"cuda_graph_warmup_steps={warmup_steps}: the rule: at least one eager step "
                "records the order to capture; fix: use 1 or more (Megatron's default is 3)"
            )
        self.warmup_steps, self.capture_fn = warmup_steps, capture
        self.steps = 0
        self.captured = False
        self.runners: dict[tuple[int, int, int], LayerRunner] = {}  # (chunk, layer, k)
        self.order: list[tuple[str, LayerRunner]] = []
        self.calls: dict[tuple[int, int], int] = {}  # (chunk, layer) -> calls this step
        for c, chunk in enumerate(chunks):
            model = chunk
            while hasattr(model, "module"):
                model = cast(torch.nn.Module, model.module)  # a DDP / FSDP wrapper
            block = getattr(model, "decoder", None)
            if block is None:
                raise TypeError(f"chunk {c} has no TransformerBlock `decoder` to graph")
            block.cuda_graphs = self
            block.cuda_graph_chunk = c

    # --- per step -----------------------------------------------------------------------
    def begin_step(self) -> None:
        """Call once at the start of every training step, before its forward passes."""
        if self.captured:
            stale = [r.name for r in self.runners.values() if r.in_flight]
            if stale:
                raise CudaGraphError(
                    f"{len(stale)} graphed layer calls (e.g. {stale[0]}) ran forward but "
                    "never backward in the previous step"
                )
        elif self.steps >= self.warmup_steps and self.order:
            self._capture_all()
        self.steps += 1
        self.calls.clear()
        if not self.captured:
            self.order = []

    def _capture_all(self) -> None:
        fwd = [r for kind, r in self.order if kind == "fwd"]
        bwd = {id(r) for kind, r in self.order if kind == "bwd"}
        missing = [r.name for r in fwd if id(r) not in bwd]
        if missing:
            raise CudaGraphError(
                f"cannot capture: {missing[0]} ran forward without backward in the recorded step"
            )
        pool = None
        if self.capture_fn is cuda_capture:  # real graphs: warm the kernels up, share a pool
            for r in fwd:
                r.warm_up()
            pool = torch.cuda.graph_pool_handle()
        for kind, runner in self.order:
            if kind == "fwd":
                runner.capture_forward(self.capture_fn, pool)
            else:
                runner.capture_backward(self.capture_fn, pool)
        self.captured = True
        self.order = []

    # --- the layer call -----------------------------------------------------------------
    def __call__(
        self, block: TransformerBlock, index: int, hidden: torch.Tensor, mask: Any, rotary: Any
    ) -> torch.Tensor:
        """Run layer `index` of `block` on `hidden` (eagerly, recorded, or replayed)."""
        layer = block.layers[index]
        if not (block.training and torch.is_grad_enabled()):
            return layer(hidden, mask, rotary)
        chunk = block.cuda_graph_chunk
        k = self.calls.get((chunk, index), 0)
        self.calls[(chunk, index)] = k + 1
        name = f"chunk {chunk} layer {index} call {k}"
        others = _tensors(mask, rotary)
        if not self.captured:
            runner = self.runners.setdefault((chunk, index, k), LayerRunner(layer, name))
            runner.record(hidden, others)
            self.order.append(("fwd", runner))
            out = layer(hidden, mask, rotary)
            return _RecordBackward.apply(self, runner, out)
        captured = self.runners.get((chunk, index, k))
        if captured is None:
            raise CudaGraphError(
                f"{name} has no captured graph: this step runs more micro-batches than the "
                "captured one (CUDA graphs need a fixed number of micro-batches per step)"
            )
        _run_forward_pre_hooks(layer, hidden)
        captured.load_inputs(hidden, others)
        last = index == len(block.layers) - 1
        return _Replay.apply(captured, last, hidden, *others, *captured.params)


def _run_forward_pre_hooks(layer: torch.nn.Module, hidden: torch.Tensor) -> None:
    """A replay skips `Module.__call__`; run the modules' forward pre-hooks it would have run
    (DDP's wait for an overlapped param all-gather) so the graph reads updated params."""
    for module in layer.modules():
        for hook in list(module._forward_pre_hooks.values()):
            hook(module, (hidden,))
