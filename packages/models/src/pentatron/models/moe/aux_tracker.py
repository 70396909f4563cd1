"""Per-layer logging of the routers' aux losses (load-balancing loss and z-loss).

Each router owns an `AuxLossRecord` and adds the detached value of its losses (without
their coefficient) once per training micro-batch. The recorded value is this rank's share:
summed over the tp x cp group it is the value for all tokens of the group. No global
state: `collect_moe_aux_losses` walks the model chunks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypeGuard

import torch

from pentatron.parallel_state import comm, current_device

# As Megatron logs them (seq_aux_loss balancing has its own name)
AUX_LOSS_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")


class AuxLossRecord:
    """Sum and count of one router's recorded losses since the last reset."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def record(self, name: str, value: torch.Tensor) -> None:
        if name not in AUX_LOSS_NAMES:
            raise ValueError(f"aux loss name {name!r}: one of {AUX_LOSS_NAMES}")
        value = value.detach().to(torch.float64)
        self.sums[name] = self.sums[name] + value if name in self.sums else value
        self.counts[name] = self.counts.get(name, 0) + 1

    def mean(self, name: str) -> torch.Tensor | None:
        if not self.counts.get(name):
            return None
        return self.sums[name] / self.counts[name]

    def reset(self) -> None:
        self.sums.clear()
        self.counts.clear()


class _Router(Protocol):
    """What the walk reads of a router (TopKRouter): found by its `aux_loss_record`."""

    layer_number: int
    weight: torch.Tensor
    aux_loss_record: AuxLossRecord


def _is_router(module: torch.nn.Module) -> TypeGuard[_Router]:
    return isinstance(getattr(module, "aux_loss_record", None), AuxLossRecord)


def _routers(model_chunks: Any) -> list[_Router]:
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    return [m for chunk in chunks for m in chunk.modules() if _is_router(m)]


def _num_layers(model_chunks: Any, routers: list[_Router]) -> int:
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    # (a chunk may be wrapped, DDP's or FSDP2's wrapper holding it as .module: a stage
    # without routers, e.g. a dense first layer and an empty stage, still knows the count)
    inner = [getattr(c, "module", None) for c in chunks]
    for owner in [*routers, *chunks, *(c for c in inner if c is not None)]:
        config = getattr(owner, "config", None)
        if config is not None and hasattr(config, "num_layers"):
            # MTP layers (Megatron's tracking) follow the decoder's: num_layers + depth
            return int(config.num_layers + (getattr(config, "mtp_num_layers", None) or 0))
    raise ValueError(
        "collect_moe_aux_losses: no router and no chunk with .config.num_layers; fix: pass "
        "num_layers= explicitly"
    )


def _groups(grid_or_groups: Any) -> tuple[Any, Any, int]:
    """(pp group, tp-dp-cp group, dp size) from a ProcessGrid, a mapping, or None."""
    if grid_or_groups is None or not torch.distributed.is_initialized():
        return None, None, 1
    if isinstance(grid_or_groups, Mapping):
        get = grid_or_groups.get
    else:
        get = grid_or_groups.group
    dp = get("dp")
    dp_size = torch.distributed.get_world_size(dp) if dp is not None else 1
    return get("pp"), get("tp-dp-cp"), dp_size


def collect_moe_aux_losses(
    model_chunks: Any, grid_or_groups: Any = None, num_layers: int | None = None
) -> dict[str, torch.Tensor]:
    """name -> `[num_layers]` float64 (0 for layers without a router), averaged over the
    recorded micro-batches.

    Collectives (every rank of the grid must call): one all-reduce(pp) (a layer lives on
    one stage), one all-reduce(tp-dp-cp) summing the tp-cp shares, then / dp size (the
    average over data-parallel replicas). `grid_or_groups`: a ProcessGrid, a mapping with
    "pp", "tp-dp-cp", "dp" groups, or None (one process). Only names some router recorded
    are returned; the records are kept (call `reset_moe_aux_losses`).
    """
    routers = _routers(model_chunks)
    layers = num_layers if num_layers is not None else _num_layers(model_chunks, routers)
    device = _comm_device(routers)
    table = torch.zeros(2, len(AUX_LOSS_NAMES), layers, dtype=torch.float64, device=device)
    for router in routers:
        index = router.layer_number - 1
        if not 0 <= index < layers:
            raise ValueError(f"router layer_number={router.layer_number} not in 1..{layers}")
        for n, name in enumerate(AUX_LOSS_NAMES):
            mean = router.aux_loss_record.mean(name)
            if mean is not None:
                table[0, n, index] += mean.to(device)
                table[1, n, index] = 1.0
    pp_group, tdc_group, dp_size = _groups(grid_or_groups)
    for group in (pp_group, tdc_group):
        if group is not None and torch.distributed.get_world_size(group) > 1:
            comm.all_reduce(table, group=group)
    table = table.cpu()  # the step's one read of the aux losses
    values, present = table[0] / dp_size, table[1] > 0
    return {name: values[n] for n, name in enumerate(AUX_LOSS_NAMES) if present[n].any()}


def _comm_device(routers: list[_Router]) -> torch.device:
    """The routers' device, else (a stage without routers) the grid's: collectives run there."""
    for router in routers:
        return router.weight.device
    return current_device()


def reset_moe_aux_losses(model_chunks: Any) -> None:
    """Forget every router's records (call after logging a step)."""
    for router in _routers(model_chunks):
        router.aux_loss_record.reset()
