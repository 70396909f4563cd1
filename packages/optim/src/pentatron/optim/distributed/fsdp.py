"""Torch FSDP2 (`fully_shard`) as the alternative data-parallel engine, behind our DDP interface.

`apply_fsdp2(module, dp)` shards every block (by default each child of a `nn.ModuleList`,
the `layers` of a transformer), then the root, over the dp mesh. Each param becomes a
`DTensor` `Shard(0)` over dp (`[n, ...]` -> `[ceil(n/d), ...]` per rank, padded), so params,
grads and optimizer state all take 1/d of their memory per rank (ZeRO-3).

Collectives, per block: forward `param[n/d]` -> all-gather(dp) -> `param[n]` (in
`param_dtype`), freed again after forward with `reshard_after_forward`; backward
`grad[n]` -> reduce-scatter(dp, averaging, in `reduce_dtype`) -> `grad[n/d]`. Both are
issued by FSDP2's own hooks, so `finish_grad_sync` and the param-sync calls are no-ops and
any torch optimizer (e.g. `torch.optim.AdamW`) steps the `DTensor` shards directly. Its
`state_dict()` holds `DTensor`s, which torch.distributed.checkpoint saves and reshards.

`fully_shard` replaces each param by a new `DTensor` parameter; the attributes our layers
set on params (`tensor_model_parallel`, `sequence_parallel`, `shared_embedding`, `shared`,
`allreduce`, ...) are copied onto it, so grad finalization and norm clipping still find
them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from pentatron.parallel_state import comm, current_device

try:  # public from torch 2.5
    from torch.distributed.tensor import DTensor
except ImportError:  # torch 2.4
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]

try:  # public from torch 2.6
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.4 / 2.5
    from torch.distributed._composable.fsdp import (  # type: ignore[no-redef]
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
    )


def default_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of every `nn.ModuleList` (transformer layers), outermost lists first."""
    blocks: list[torch.nn.Module] = []
    for m in module.modules():
        if isinstance(m, torch.nn.ModuleList):
            blocks += [b for b in m if not any(b is x for x in blocks)]
    return blocks


def _as_mesh(dp: DeviceMesh | Any, device_type: str) -> DeviceMesh:
    if isinstance(dp, DeviceMesh):
        return dp
    return DeviceMesh.from_group(dp, device_type)


class FSDP2DataParallel(torch.nn.Module):
    """A module sharded by `fully_shard`, with the calls a training loop makes on our DDP.

    Build it with `apply_fsdp2`. Gradient accumulation: by default every micro-batch's
    backward reduce-scatters its grads, which accumulate in their dp shards, so grads take
    1/d of their memory throughout (ZeRO-3; as torchtitan and Megatron's torch FSDP2 do)
    and `no_sync()` changes nothing. With `defer_reduce=True`, `no_sync()` keeps unsharded
    grads instead, in the reduce dtype, for every param of the module until the last
    micro-batch (outside it) reduces them: one reduce-scatter per step, at the memory of an
    unsharded grad buffer (4 bytes a param in fp32). `zero_grad_buffer()` drops the grads;
    the grad- and param-sync calls are no-ops because FSDP2 issues them itself.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        dp_mesh: DeviceMesh,
        dp_group: Any = None,
        defer_reduce: bool = False,
        expert_dp_group: Any = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, FSDPModule):
            raise TypeError("FSDP2DataParallel wraps a fully_shard-ed module; use apply_fsdp2")
        self.module = module
        self.dp_mesh = dp_mesh
        # The process group itself: a mesh made from a group resolves it by a registered
        # name, which torch may map to a destroyed group once grids are re-created.
        self.dp_group = dp_mesh.get_group() if dp_group is None else dp_group
        self.defer_reduce = defer_reduce
        self.expert_dp_group = expert_dp_group  # experts' own mesh (apply_fsdp2's expert_dp)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """With `defer_reduce`, micro-batches run inside only accumulate unsharded grads; the
        last one, outside, reduces. Without it (the default) a no-op: every micro-batch
        reduce-scatters and the grads accumulate sharded."""
        if not self.defer_reduce:
            yield
            return
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def start_grad_sync(self) -> None:
        """No-op: FSDP2 launches each block's reduce-scatter in backward."""

    def finish_grad_sync(self) -> None:
        """No-op: FSDP2 waits for its reduce-scatters at the end of backward."""

    def start_param_sync(self, async_op: bool | None = None) -> None:
        """No-op: FSDP2 all-gathers each block's params before its forward."""

    def finish_param_sync(self) -> None:
        """No-op (see `start_param_sync`)."""

    def zero_grad_buffer(self) -> None:
        self.module.zero_grad(set_to_none=True)

    def reshard(self) -> None:
        """Free the params a forward-only pass left gathered: without a backward, FSDP2
        keeps the root's (and, without reshard_after_forward, every block's) unsharded
        `[n, ...]` until the next forward, so a checkpoint saved after an evaluation would
        see whole params instead of this rank's `[ceil(n/d), ...]` shard."""
        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def held_rows(self, param: torch.Tensor) -> tuple[int, int]:
        """Rows `[lo, hi)` of dim 0 of `param` (one of this module's `Shard(0)` params) that
        this rank holds: torch.chunk's cut over its mesh (dp, or for experts with
        `expert_dp` the expert-data-parallel group), `ceil(n/d)` rows a rank, the last ones
        fewer or none."""
        expert = getattr(param, "allreduce", True) is False
        group = self.expert_dp_group if expert and self.expert_dp_group else self.dp_group
        n, d = param.shape[0], dist.get_world_size(group)
        rows = -(-n // d)
        lo = min(n, dist.get_rank(group) * rows)
        hi = min(n, lo + rows)
        if local_tensor(param).shape[0] != hi - lo:
            raise RuntimeError(f"FSDP2 shard of {n} rows over {d}: expected {hi - lo} rows here")
        return lo, hi

    def local_grads(self) -> list[torch.Tensor]:
        """This rank's shard of every grad (after backward: reduce-scattered over dp)."""
        return [local_tensor(p.grad) for p in self.module.parameters() if p.grad is not None]

    def scale_gradients(self, factor: float | torch.Tensor) -> None:
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The module's state dict (no `module.` prefix), params as `DTensor` shards."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def apply_fsdp2(
    module: torch.nn.Module,
    dp: DeviceMesh | Any,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    blocks: Iterable[torch.nn.Module] | None = None,
    broadcast_params: bool = True,
    defer_reduce: bool = False,
    expert_dp: DeviceMesh | Any = None,
) -> FSDP2DataParallel:
    """Shard `module` over `dp` (a 1-D `DeviceMesh` or a process group) with FSDP2.

    `param_dtype`: dtype params are all-gathered in for compute (None: as stored, e.g. bf16
    compute over fp32 sharded params with `torch.bfloat16`); `reduce_dtype`: dtype of the
    grad reduce-scatter. `blocks` (default `default_blocks(module)`) get their own
    `fully_shard` so one block's params are gathered at a time; the root takes the rest.
    `broadcast_params` first copies the params of dp rank 0 to every rank (as our DDP does),
    so the shards cut from them agree. `defer_reduce`: see `FSDP2DataParallel` (False:
    reduce-scatter every micro-batch, grads stay sharded).

    `expert_dp` (expert parallelism): the expert-data-parallel mesh or group. Each module
    holding only expert params (`expert_blocks`: Megatron's `allreduce = False` marker),
    outermost first, becomes its own unit over it, nested in its layer's: its rows are cut
    over edp, and its grads are summed over edp and divided by dp (not edp), as our DDP
    reduces them: an expert's grad gathers the tokens of every dp rank of its ep group, and
    the loss is a mean over dp.
    """
    first = next(module.parameters(), None)  # (a custom layout's empty stage has none)
    device = first.device if first is not None else current_device()
    mesh = _as_mesh(dp, device.type)
    group = dp.get_group() if isinstance(dp, DeviceMesh) else dp
    if broadcast_params:
        src = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for p in module.parameters():
                comm.broadcast(p.data, src=src, group=group)
    attrs = {name: dict(vars(p)) for name, p in module.named_parameters()}
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    expert_group = None
    if expert_dp is not None:
        expert_mesh = _as_mesh(expert_dp, device.type)
        expert_group = expert_dp.get_group() if isinstance(expert_dp, DeviceMesh) else expert_dp
        for block in expert_blocks(module):
            fully_shard(
                block,
                mesh=expert_mesh,
                mp_policy=policy,
                reshard_after_forward=reshard_after_forward,
            )
            unit = cast(FSDPModule, block)
            if not hasattr(unit, "set_force_sum_reduction_for_comms"):
                raise RuntimeError(
                    f"expert_dp with torch {torch.__version__}: the rule: experts reduce "
                    "with FSDP2's set_gradient_divide_factor and "
                    "set_force_sum_reduction_for_comms, which this torch lacks; fix: a newer "
                    "torch, or DDP (with the distributed optimizer) for expert parallelism"
                )
            unit.set_gradient_divide_factor(float(dist.get_world_size(group)))
            if dist.get_backend(expert_group) == "gloo":  # no PREMUL_SUM there
                unit.set_force_sum_reduction_for_comms(True)  # sum, then divide
    for block in default_blocks(module) if blocks is None else blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # The root's params are used last in forward and first in backward: keep them gathered.
    fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    for name, p in module.named_parameters():
        for key, value in attrs.get(name, {}).items():
            setattr(p, key, value)
    return FSDP2DataParallel(module, mesh, group, defer_reduce, expert_group)


def expert_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost submodules whose params are all expert params (Megatron's
    `allreduce = False`): MoE layers' experts."""
    out: list[tuple[str, torch.nn.Module]] = []
    for name, m in module.named_modules():
        params = list(m.parameters())
        if not params or not all(getattr(p, "allreduce", True) is False for p in params):
            continue
        if not any(name.startswith(f"{outer}.") for outer, _ in out):
            out.append((name, m))
    return [m for _, m in out]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a `DTensor` (a view: writes reach the DTensor), else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t
