"""Split backward for zero-bubble pipeline schedules: B now, W later.

A zero-bubble schedule splits each micro-batch's backward into B, the input gradient the
previous stage waits for, and W, the weight gradient only the optimizer needs, and runs W
where the pipeline would idle (Qi et al., arXiv 2401.10241). Inside `store.defer()` the
parallel linears (column, row, layer-norm column, the output layer: every caller of
`linear_with_grad_accumulation_and_async_allreduce`) compute only their input gradient in
backward and queue their weight and bias gradients here; the schedule then calls
`close_group()` after each B and `run_oldest()` for each W, oldest first.

A queued W holds the linear's input (the `[s/t, b, i]` shard under sequence parallelism
with `regather_input`, gathered again in W) and its output gradient `[s, b, o]`:
`pending_bytes()` is that cost. Another layer defers the same way: in its backward, if
`deferring_store()` is not None, push a `DeferredWeightGrad`: the norms (`rms_norm`,
`layer_norm`, also inside the fused norm + linear), `VocabParallelEmbedding`'s table and
pentatron.models' routed experts (weights and biases) do. Autograd's own ops (routers, a
row layer's bias added after the reduction) keep their weight gradients in B: a small
share of the FLOPs.

W hands its gradients to autograd (`torch.autograd.backward` on the weight and bias), so
whatever hooks the parameters carry run as in an undivided backward: DDP's hook adds the
grad into `main_grad` (or, with gradient-accumulation fusion, finds it there already) and,
outside `no_sync`, marks the param ready, so a bucket is reduced only after its W ran.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator

import torch

_DEFERRING: list[WeightGradStore] = []  # the store of the `defer()` now open, if any


def deferring_store() -> WeightGradStore | None:
    """The store whose `defer()` is open (read by the linears' backward), else None.

    A module global, not a thread-local: on a GPU autograd runs backward on its own thread.
    """
    return _DEFERRING[-1] if _DEFERRING else None


class DeferredWeightGrad:
    """One queued W: `compute()` returns (tensor, grad) pairs to hand to autograd."""

    def __init__(self, compute: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]], nbytes: int):
        self.compute, self.nbytes = compute, nbytes

    def run(self) -> None:
        with torch.no_grad():  # as inside autograd's backward: no graph for the GEMM
            pairs = self.compute()
        if pairs:
            tensors, grads = zip(*pairs)
            torch.autograd.backward(list(tensors), grad_tensors=list(grads))


class WeightGradStore:
    """The weight gradients of the micro-batches whose B ran and whose W has not, in order.

    Use: `with store.defer(): <backward of micro-batch k>`, then `store.close_group()`;
    later `store.run_oldest()` computes micro-batch k's weight gradients (FIFO). The
    pipeline package's zero-bubble schedules take a store as `PipelineConfig.weight_grad_store`.
    """

    def __init__(self) -> None:
        self._open: list[DeferredWeightGrad] = []
        self._groups: deque[list[DeferredWeightGrad]] = deque()

    @contextlib.contextmanager
    def defer(self) -> Iterator[None]:
        """Backward run inside queues the parallel linears' weight gradients here."""
        _DEFERRING.append(self)
        try:
            yield
        finally:
            _DEFERRING.pop()

    def push(self, item: DeferredWeightGrad) -> None:
        self._open.append(item)

    def close_group(self) -> None:
        """Seal what was queued since the last call as one W (one micro-batch's)."""
        self._groups.append(self._open)
        self._open = []

    def run_oldest(self) -> None:
        """Run the oldest sealed W: its grads reach the params (and their hooks) now."""
        if not self._groups:
            raise RuntimeError(
                "WeightGradStore.run_oldest() with no sealed group: every W needs its B first "
                "(call close_group() after each deferred backward)"
            )
        group = self._groups.popleft()
        while group:
            group.pop(0).run()  # popped first: its saved tensors go as soon as it ran

    def run_all(self) -> None:
        while self._groups:
            self.run_oldest()

    def __len__(self) -> int:
        """Sealed groups pending (W's not yet run)."""
        return len(self._groups)

    def pending_bytes(self) -> int:
        """Bytes of the tensors the pending W's hold (sealed and open)."""
        return sum(item.nbytes for group in (*self._groups, self._open) for item in group)

    def clear(self) -> None:
        """Drop every pending W (after an error: their grads are lost)."""
        self._open, self._groups = [], deque()
