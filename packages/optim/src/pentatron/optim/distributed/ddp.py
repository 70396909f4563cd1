"""`DistributedDataParallel`: Megatron-style DDP over contiguous, bucketed grad buffers.

Backward hooks accumulate each param's grad into `param.main_grad` (a view of its buffer).
In the last micro-batch (outside `no_sync()`), a hook also marks the param ready, and when
every param of a bucket is ready with `overlap_grad_reduce` the bucket's async reduction
starts while backward continues. `finish_grad_sync()` waits for (or, without overlap,
issues) the reductions. Dense params reduce over dp x cp; expert params (Megatron marks them
`param.allreduce = False`) over the expert-data-parallel group.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from pentatron.parallel_state import ProcessGrid, comm, get_default_grid

from .ddp_config import DDPConfig
from .grad_buffer import ParamAndGradBuffer


def is_expert_param(param: torch.nn.Parameter) -> bool:
    """Megatron's marker: expert params set `allreduce = False` (they reduce over edp)."""
    return not getattr(param, "allreduce", True)


def _weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method`, holding its object weakly. A param keeps its post-accumulate-grad hooks
    where the garbage collector cannot see them, so a bound method there would make the
    wrapper, its module and its process groups immortal (and the groups' gloo threads
    outlive the run: see `parallel_state.shutdown`)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return call


class DistributedDataParallel(torch.nn.Module):
    """Wrap `module` so its grads land in bucketed buffers reduced over data parallel ranks.

    Groups: `dp_group` (default `grid.group("dp-cp")`) for dense params and `expert_dp_group`
    (default `grid.group("edp")`) for expert params; `grid` defaults to the default grid and
    is only read when a group is not given.
    """

    def __init__(
        self,
        config: DDPConfig,
        module: torch.nn.Module,
        *,
        grid: ProcessGrid | None = None,
        dp_group: Any = None,
        expert_dp_group: Any = None,
        broadcast_params: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        self.module = module
        if dp_group is None or expert_dp_group is None:
            grid = grid or get_default_grid()
            dp_group = dp_group if dp_group is not None else grid.group("dp-cp")
            expert_dp_group = expert_dp_group if expert_dp_group is not None else grid.group("edp")
        self.dp_group, self.expert_dp_group = dp_group, expert_dp_group
        self.is_last_microbatch = True
        params = [p for p in module.parameters() if p.requires_grad]
        dense = [p for p in params if not is_expert_param(p)]
        expert = [p for p in params if is_expert_param(p)]
        self.dense_buffers = self._make_buffers(dense, dp_group, "dense")
        self.expert_buffers = self._make_buffers(expert, expert_dp_group, "expert")
        self.param_to_buffer = {p: b for b in self.all_buffers for p in b.params}
        for p in params:
            # Layers that accumulate dW straight into `main_grad` (gradient accumulation
            # fusion) set this and hand autograd a dummy grad, so the hook below still fires.
            p.grad_added_to_main_grad = False  # type: ignore[attr-defined]  # not in torch stubs
        grad_hook = _weak_method(self._grad_hook)
        self._hooks = [p.register_post_accumulate_grad_hook(grad_hook) for p in params]
        if config.overlap_param_gather:
            self._hooks += [
                m.register_forward_pre_hook(self._wait_for_params) for m in module.modules()
            ]
            self._hooks.append(self.register_forward_pre_hook(self._wait_before_compiled))
        if broadcast_params:
            self.broadcast_params()

    # --- construction ------------------------------------------------------------------
    @property
    def all_buffers(self) -> list[ParamAndGradBuffer]:
        return [*self.dense_buffers, *self.expert_buffers]

    def _make_buffers(
        self, params: list[torch.nn.Parameter], group: Any, kind: str
    ) -> list[ParamAndGradBuffer]:
        cfg = self.config
        dp_cp = dist.get_world_size(self.dp_group)
        size = dist.get_world_size(group) if params else 1
        # Expert grads carry the tokens of the whole dp x cp batch (routed by all-to-all),
        # so both kinds are averaged over dp x cp, although experts sum over edp only.
        if cfg.average_in_collective:
            op, scale = dist.ReduceOp.AVG, (size / dp_cp if kind == "expert" else 1.0)
        else:
            op, scale = dist.ReduceOp.SUM, 1.0 / dp_cp
        by_dtype: dict[tuple[torch.dtype, torch.dtype], list[torch.nn.Parameter]] = {}
        for p in reversed(params):  # reverse-backward order: first-ready grads first
            grad_dtype = torch.float32 if cfg.grad_reduce_in_fp32 else p.dtype
            by_dtype.setdefault((p.dtype, grad_dtype), []).append(p)
        out = []
        for (_, grad_dtype), group_params in by_dtype.items():
            own = [
                cfg.use_distributed_optimizer and bool(getattr(p, "shared_embedding", False))
                for p in group_params
            ]
            out.append(
                ParamAndGradBuffer(
                    group_params,
                    grad_dtype=grad_dtype,
                    bucket_size=cfg.resolved_bucket_size(size),
                    dp_group=group,
                    use_distributed_optimizer=cfg.use_distributed_optimizer,
                    gradient_scaling_factor=scale,
                    reduce_op=op,
                    check_for_nan_in_grad=cfg.check_for_nan_in_grad,
                    own_bucket=own,
                    name=kind,
                )
            )
        return out

    # --- hooks -------------------------------------------------------------------------
    def _grad_hook(self, param: torch.nn.Parameter) -> None:
        # torch stubs lack the .main_grad and .grad_added_to_main_grad set in __init__
        in_main_grad = param.grad_added_to_main_grad  # type: ignore[attr-defined]
        if param.grad is None and not in_main_grad:
            # Nothing arrived: autograd runs this hook in a split backward's B for a weight
            # whose gradient comes later, in W (tp_layers' WeightGradStore); ready then.
            return
        if not in_main_grad:
            # accumulate across micro-batches, in grad dtype
            param.main_grad.add_(param.grad)  # type: ignore[attr-defined]
        param.grad = None
        param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        if self.config.overlap_grad_reduce and self.is_last_microbatch:
            self.param_to_buffer[param].register_grad_ready(param)

    def _wait_for_params(self, module: torch.nn.Module, args: Any) -> None:
        # overlap_param_gather: the all-gather of this module's params was launched after the
        # optimizer step; wait for it only now, just before the params are first read.
        if torch.compiler.is_compiling():
            return  # traced in a compiled module, where a wait cannot be: see below
        for p in module.parameters(recurse=False):
            buffer = self.param_to_buffer.get(p)
            if buffer is not None:
                buffer.finish_param_sync(buffer.param_to_bucket[p])

    def _wait_before_compiled(self, wrapper: torch.nn.Module, args: Any) -> None:
        # A module compiled in place (`module.compile()`) runs its submodules' hooks traced by
        # Dynamo, which cannot wait on a collective's handle: wait for every param before the
        # wrapped model runs. No later than the per-module waits: the all-gathers start in
        # bucket order, last layers first, so the first layers' bucket arrives last anyway.
        if any(getattr(m, "_compiled_call_impl", None) is not None for m in self.module.modules()):
            self.finish_param_sync()

    # --- public API --------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches run inside only accumulate grads; the last one, outside, reduces."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    def start_grad_sync(self) -> None:
        """Launch (async) the reductions of every bucket not yet launched."""
        for buffer in self.all_buffers:
            for bucket in buffer.buckets:
                if not bucket.grad_launched:
                    buffer.start_grad_sync(bucket, async_op=True)

    def finish_grad_sync(self) -> None:
        """After this, `main_grad` holds dp-averaged grads (sharded: this rank's shard only)."""
        for buffer in self.all_buffers:
            buffer.finish_grad_sync()

    def zero_grad_buffer(self) -> None:
        for p in self.param_to_buffer:
            p.grad = None
        for buffer in self.all_buffers:
            buffer.zero_grad()

    def local_grads(self) -> list[torch.Tensor]:
        """The grad storage this rank holds (one flat buffer per dtype and kind)."""
        return [b.grad_data for b in self.all_buffers]

    def scale_gradients(self, factor: float | torch.Tensor) -> None:
        for buffer in self.all_buffers:
            buffer.scale_gradients(factor)

    def start_param_sync(self, async_op: bool | None = None) -> None:
        """Distributed optimizer: all-gather updated param shards (async if overlapping)."""
        overlap = self.config.overlap_param_gather if async_op is None else async_op
        for buffer in self.all_buffers:
            if buffer.sharded:
                buffer.start_param_sync(async_op=overlap)

    def finish_param_sync(self) -> None:
        for buffer in self.all_buffers:
            buffer.finish_param_sync()

    def reshard(self) -> None:
        """No-op: DDP params are whole on every rank (FSDP2's frees gathered params)."""

    def broadcast_params(self) -> None:
        """Make every dp replica start from the params of its group's first rank."""
        for buffer in self.all_buffers:
            src = dist.get_global_rank(buffer.dp_group, 0)
            if buffer.param_data is not None:
                comm.broadcast(buffer.param_data, src=src, group=buffer.dp_group)
            else:
                for p in buffer.params:
                    comm.broadcast(p.data, src=src, group=buffer.dp_group)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        self.finish_param_sync()
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
