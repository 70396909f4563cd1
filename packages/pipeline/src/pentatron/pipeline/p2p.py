"""Point-to-point messages between adjacent pipeline stages (Megatron's p2p_communication).

Activations travel forward (to the next pipeline rank), their gradients backward (to the
previous one); ranks form a ring, so the last rank's "next" is rank 0 (the interleaved
schedule uses that edge between chunks). Every call goes through the traced collectives of
`pentatron.parallel_state.comm`, so `comm.trace()` counts messages and bytes.

Two ways to issue one exchange:
- batched (`batch_p2p_comm=True`): all sends and receives of the call in one
  batch_isend_irecv, then wait on all;
- unbatched: single isend/irecv in Megatron's even/odd order (even pipeline ranks send
  before they receive, odd ranks receive before they send), so the exchange cannot
  deadlock even where sends are blocking.
With `wait=False` (overlap_p2p_comm, or a zero-bubble schedule running W's while a
message travels) the handles come back unwaited, keyed "send_next", "recv_prev",
"send_prev", "recv_next", and the caller waits when the tensor is needed.

Matching: a receiver matches messages from one sender in the order they were posted. So
that an activation and a gradient between the same two ranks can never be swapped (p = 2,
where next == prev), forward-direction messages use the pp group and backward-direction
messages a second channel (the pp group when p > 2, the default group when p = 2, as
Megatron does), and inside a call forward messages are posted before backward ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pentatron.parallel_state import comm, current_device

from .config import PipelineConfig
from .timeline import Timeline

Shape = Sequence[int]


class P2PCommunicator:
    """The p2p layer of one pipeline rank.

    Args:
      pp_group: the pipeline process group holding this rank.
      pp_ranks: global ranks of that group, in pipeline order.
      config: dtype, shapes mode, batching.
      rank: this process's global rank (default: torch.distributed's).
    Use `P2PCommunicator.from_grid(grid, config)` with a ProcessGrid.
    """

    def __init__(
        self,
        pp_group: Any,
        pp_ranks: Sequence[int],
        config: PipelineConfig,
        rank: int | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        self.pp_group = pp_group
        self.pp_ranks = list(pp_ranks)
        self.config = config
        self.global_rank = dist.get_rank() if rank is None else rank
        self.pp_rank = self.pp_ranks.index(self.global_rank)
        self.pp_size = len(self.pp_ranks)
        self.next_rank = self.pp_ranks[(self.pp_rank + 1) % self.pp_size]
        self.prev_rank = self.pp_ranks[(self.pp_rank - 1) % self.pp_size]
        # p = 2: next == prev, so the backward stream gets its own channel (see module doc).
        self.grad_group = pp_group if self.pp_size > 2 else None
        self.timeline = timeline
        self.device = current_device()

    @classmethod
    def from_grid(
        cls, grid: Any, config: PipelineConfig, timeline: Timeline | None = None
    ) -> P2PCommunicator:
        return cls(grid.group("pp"), grid.ranks("pp"), config, grid.global_rank, timeline)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    # --- the one primitive ----------------------------------------------------------------
    def communicate(
        self,
        *,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
        tensor_shape: Shape | None = None,
        wait: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, Any]]:
        """Send/receive to both neighbours at once.

        `send_next` `[s, b, h]` -> next rank; `send_prev` `[s, b, h]` -> previous rank.
        Returns (tensor from prev or None, tensor from next or None, unwaited handles).
        Received tensors are fresh `[s, b, h]` tensors of `pipeline_dtype` with
        requires_grad=True (they are the next stage's autograd inputs).
        """
        prev_shape: Shape | None
        next_shape: Shape | None
        shape_sends: dict[str, Any] = {}
        if self.config.variable_seq_lengths:
            prev_shape, next_shape, shape_sends = self._exchange_shapes(
                send_next, send_prev, recv_prev, recv_next
            )
        else:
            if (recv_prev or recv_next) and tensor_shape is None:
                raise ValueError("tensor_shape is required to receive (fixed sequence length)")
            prev_shape = next_shape = tensor_shape
        buf_prev = self._buffer(prev_shape) if recv_prev else None
        buf_next = self._buffer(next_shape) if recv_next else None
        with self._record("p2p"):
            handles = self._start(send_next, send_prev, buf_prev, buf_next)
            for key, shape_send in shape_sends.items():  # a send's handle covers its shape
                handles[key] = _Chained(shape_send, handles[key])
            if wait:
                for h in handles.values():
                    h.wait()
                handles = {}
        return buf_prev, buf_next, handles

    def _buffer(self, shape: Shape | None) -> torch.Tensor:
        return torch.empty(
            tuple(shape or ()),
            dtype=self.config.pipeline_dtype,
            device=self.device,
            requires_grad=True,
        )

    def _ops(
        self,
        send_next: torch.Tensor | None,
        send_prev: torch.Tensor | None,
        buf_prev: torch.Tensor | None,
        buf_next: torch.Tensor | None,
    ) -> list[tuple[str, str, torch.Tensor, int, Any]]:
        """(key, op, tensor, peer, group) in posting order for this rank."""
        fwd = [
            ("send_next", "send", send_next, self.next_rank, self.pp_group),
            ("recv_prev", "recv", buf_prev, self.prev_rank, self.pp_group),
        ]
        bwd = [
            ("send_prev", "send", send_prev, self.prev_rank, self.grad_group),
            ("recv_next", "recv", buf_next, self.next_rank, self.grad_group),
        ]
        if not self.config.batch_p2p_comm and self.pp_rank % 2 == 1:
            # Odd ranks receive before they send (even ranks send first): the pairs match.
            fwd.reverse()
            bwd.reverse()
        return [
            (k, op, _contiguous(t), peer, g) for k, op, t, peer, g in fwd + bwd if t is not None
        ]

    def _start(
        self,
        send_next: torch.Tensor | None,
        send_prev: torch.Tensor | None,
        buf_prev: torch.Tensor | None,
        buf_next: torch.Tensor | None,
    ) -> dict[str, Any]:
        ops = self._ops(send_next, send_prev, buf_prev, buf_next)
        if not ops:
            return {}
        if self.config.batch_p2p_comm:
            # torch batches ops of one group only: one batch per channel, forward first.
            handles = {}
            for channel in _unique(g for *_, g in ops):
                mine = [o for o in ops if o[4] is channel]
                works = comm.batch_isend_irecv(
                    [comm.P2POp(op, t, peer, g) for _, op, t, peer, g in mine]
                )
                handles.update({key: w for (key, *_), w in zip(mine, works)})
            return handles
        handles = {}
        for key, op, t, peer, g in ops:
            fn = comm.isend if op == "send" else comm.irecv
            handles[key] = fn(t, peer, group=g)
        return handles

    def _exchange_shapes(
        self,
        send_next: torch.Tensor | None,
        send_prev: torch.Tensor | None,
        recv_prev: bool,
        recv_next: bool,
    ) -> tuple[list[int], list[int], dict[str, Any]]:
        """Variable sequence lengths: each data message is preceded by its int64 shape `[3]`.
        Returns the received shapes and the handles of the shape sends, still in flight."""

        def shape_of(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if t.dim() != 3:
                raise ValueError(
                    f"variable_seq_lengths sends [s, b, h] tensors; got {tuple(t.shape)}"
                )
            return torch.tensor(t.shape, dtype=torch.int64, device=self.device)

        prev = torch.empty(3, dtype=torch.int64, device=self.device) if recv_prev else None
        nxt = torch.empty(3, dtype=torch.int64, device=self.device) if recv_next else None
        handles = self._start(shape_of(send_next), shape_of(send_prev), prev, nxt)
        # Wait for the shapes this rank receives only: a neighbour may take the shape this
        # rank sends in its next call, after this call's data has moved (the stages' calls
        # need not pair up one to one), so waiting for the sends here could deadlock.
        for key in ("recv_prev", "recv_next"):
            if key in handles:
                handles.pop(key).wait()
        return (
            prev.tolist() if prev is not None else [0, 0, 0],
            nxt.tolist() if nxt is not None else [0, 0, 0],
            handles,
        )

    def _record(self, kind: str) -> Any:
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(kind)

    # --- Megatron's named combinations -----------------------------------------------------
    def recv_forward(
        self, tensor_shape: Shape | None, is_first_stage: bool | None = None
    ) -> torch.Tensor | None:
        """Activation `[s, b, h]` from the previous stage (None on the first stage)."""
        if self.is_first_stage if is_first_stage is None else is_first_stage:
            return None
        return self.communicate(recv_prev=True, tensor_shape=tensor_shape)[0]

    def recv_backward(
        self, tensor_shape: Shape | None, is_last_stage: bool | None = None
    ) -> torch.Tensor | None:
        """Gradient `[s, b, h]` of this stage's output from the next stage (None on the last)."""
        if self.is_last_stage if is_last_stage is None else is_last_stage:
            return None
        return self.communicate(recv_next=True, tensor_shape=tensor_shape)[1]

    def send_forward(
        self, output_tensor: torch.Tensor | None, is_last_stage: bool | None = None
    ) -> None:
        if (
            self.is_last_stage if is_last_stage is None else is_last_stage
        ) or output_tensor is None:
            return
        self.communicate(send_next=output_tensor)

    def send_backward(
        self, input_tensor_grad: torch.Tensor | None, is_first_stage: bool | None = None
    ) -> None:
        if (
            self.is_first_stage if is_first_stage is None else is_first_stage
        ) or input_tensor_grad is None:
            return
        self.communicate(send_prev=input_tensor_grad)

    def send_forward_recv_backward(
        self,
        output_tensor: torch.Tensor | None,
        tensor_shape: Shape | None,
        is_last_stage: bool | None = None,
    ) -> torch.Tensor | None:
        if self.is_last_stage if is_last_stage is None else is_last_stage:
            return None
        return self.communicate(send_next=output_tensor, recv_next=True, tensor_shape=tensor_shape)[
            1
        ]

    def send_backward_recv_forward(
        self,
        input_tensor_grad: torch.Tensor | None,
        tensor_shape: Shape | None,
        is_first_stage: bool | None = None,
    ) -> torch.Tensor | None:
        if self.is_first_stage if is_first_stage is None else is_first_stage:
            return None
        return self.communicate(
            send_prev=input_tensor_grad, recv_prev=True, tensor_shape=tensor_shape
        )[0]

    def send_forward_recv_forward(
        self,
        output_tensor: torch.Tensor | None,
        recv_prev: bool,
        tensor_shape: Shape | None,
        overlap_p2p_comm: bool = False,
    ) -> Any:
        """Send an activation on, receive the next one; with overlap also return handles."""
        recv, _, handles = self.communicate(
            send_next=output_tensor,
            recv_prev=recv_prev,
            tensor_shape=tensor_shape,
            wait=not overlap_p2p_comm,
        )
        return (recv, handles) if overlap_p2p_comm else recv

    def send_backward_recv_backward(
        self,
        input_tensor_grad: torch.Tensor | None,
        recv_next: bool,
        tensor_shape: Shape | None,
        overlap_p2p_comm: bool = False,
    ) -> Any:
        """Send a gradient back, receive the next one; with overlap also return handles."""
        _, recv, handles = self.communicate(
            send_prev=input_tensor_grad,
            recv_next=recv_next,
            tensor_shape=tensor_shape,
            wait=not overlap_p2p_comm,
        )
        return (recv, handles) if overlap_p2p_comm else recv

    def send_forward_backward_recv_forward_backward(
        self,
        output_tensor: torch.Tensor | None,
        input_tensor_grad: torch.Tensor | None,
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Shape | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Both directions in one exchange: (activation from prev, gradient from next)."""
        recv_p, recv_n, _ = self.communicate(
            send_next=output_tensor,
            send_prev=input_tensor_grad,
            recv_prev=recv_prev,
            recv_next=recv_next,
            tensor_shape=tensor_shape,
        )
        return recv_p, recv_n


def _unique(items: Any) -> list[Any]:
    out: list[Any] = []
    for item in items:
        if not any(item is seen for seen in out):
            out.append(item)
    return out


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    # Sends read raw memory; a strided view would send the wrong elements.
    if t.is_contiguous():
        return t
    return t.detach().contiguous()


class _Chained:
    """One handle for a shape message and the data message after it (each waited once)."""

    def __init__(self, *handles: Any) -> None:
        self.handles = list(handles)

    def wait(self) -> None:
        while self.handles:
            self.handles.pop(0).wait()
