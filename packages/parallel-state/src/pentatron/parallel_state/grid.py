"""`ProcessGrid`: this rank's process groups for every family of the 5-D grid.

`initialize_model_parallel(config)` validates the layout against the world size, computes
every family's rank lists (no collective yet), then creates the groups. It sets the grid as
the default used by the Megatron-named accessors in `accessors.py`; code that communicates
should still be handed the grid or its groups explicitly.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Imported now, before any process group exists, for `shutdown`'s sake: its functions take
# `group=group.WORLD` as a default argument, which Python evaluates once, at import. Imported
# after `init_process_group` (DCP and FSDP import it), it would hold the default group
# for the life of the process, and that group's gloo threads would outlive `shutdown`.
import torch.distributed.nn

from . import comm
from .config import ParallelConfig, ResolvedLayout
from .device import DeviceChoice, bind_local_device, choose_backend
from .layout import FAMILIES, GridLayout, canonical


class ProcessGrid:
    """The groups this rank belongs to, by family name (see `layout.FAMILIES` and aliases)."""

    def __init__(
        self,
        config: ParallelConfig,
        layout: ResolvedLayout,
        grid: GridLayout,
        rank: int,
        groups: dict[str, Any],
        device_choice: DeviceChoice,
        device: torch.device | None = None,
        host_group: Any = None,
    ) -> None:
        self.config = config
        self.layout = layout
        self.grid_layout = grid
        self.global_rank = rank
        self.device_choice = device_choice
        self.device = device if device is not None else torch.device(device_choice.device_type)
        """Where this rank's model, batches, losses and collective tensors live."""
        self.host_group = host_group
        """Every rank, on the host backend (gloo): CPU tensors for host-side coordination
        (flags agreed between ranks, barriers around file writes, object broadcasts)."""
        self._groups = groups
        self._twins: dict[str, Any] = {}
        self.hierarchical_cp_groups: list[Any] = []
        """This rank's group at each level of `config.hierarchical_cp` (Megatron's
        `get_hierarchical_context_parallel_groups`), level 0 first; [] without it."""
        self.virtual_pipeline_rank: int | None = 0 if layout.vpp else None

    # --- per-family queries ------------------------------------------------------------
    def group(self, name: str) -> Any:
        """The process group of family `name` holding this rank (None: rank not a member)."""
        return self._groups.get(canonical(name))

    def twin_group(self, name: str) -> Any:
        """A second group over the same ranks as this rank's group of `name`, named
        "<name>-twin" in collective errors, with the grid's backend and timeout.

        Why: between two ranks a group carries point-to-point messages as one ordered
        queue per direction (NCCL matches them in issue order); a schedule with two
        independent streams between the same pair (ZBV's two chunks) gives each its own.
        Made on the first call, which is collective over the world (`new_group`): every
        rank must make it at the same point; cached after. Destroyed with the grid.
        """
        family = canonical(name)
        if family not in self._twins:
            for ranks in self.all_ranks(family):  # every rank, every group, one order
                group = dist.new_group(
                    ranks=ranks, timeout=self.config.timeout, backend=self.device_choice.backend
                )
                if self.global_rank in ranks:
                    self._twins[family] = group
                    comm.register_group_name(group, f"{family}-twin")
        return self._twins.get(family)

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's group of `name` ([] if this rank is not a member)."""
        return self.grid_layout.ranks(name, self.global_rank) or []

    def rank(self, name: str) -> int:
        """This rank's index inside its group of `name`."""
        ranks = self.ranks(name)
        if not ranks:
            raise ValueError(f"rank {self.global_rank} is in no {canonical(name)!r} group")
        return ranks.index(self.global_rank)

    def size(self, name: str) -> int:
        ranks = self.ranks(name)
        if not ranks:
            raise ValueError(f"rank {self.global_rank} is in no {canonical(name)!r} group")
        return len(ranks)

    def all_ranks(self, name: str) -> list[list[int]]:
        """Every group of family `name`, as global rank lists."""
        return self.grid_layout.families[canonical(name)]

    # --- pipeline helpers --------------------------------------------------------------
    @property
    def pp_rank(self) -> int:
        return self.rank("pp")

    def is_first_stage(self, ignore_virtual: bool = True) -> bool:
        if not ignore_virtual and self.virtual_pipeline_rank not in (None, 0):
            return False
        return self.pp_rank == 0

    def is_last_stage(self, ignore_virtual: bool = True) -> bool:
        if (
            not ignore_virtual
            and self.layout.vpp
            and self.virtual_pipeline_rank != self.layout.vpp - 1
        ):
            return False
        return self.pp_rank == self.layout.pp - 1

    @property
    def next_pipeline_rank(self) -> int:
        """Global rank of the next stage (wrapping around, as Megatron's ring)."""
        ranks = self.ranks("pp")
        return ranks[(self.pp_rank + 1) % len(ranks)]

    @property
    def prev_pipeline_rank(self) -> int:
        ranks = self.ranks("pp")
        return ranks[(self.pp_rank - 1) % len(ranks)]

    def in_embedding_group(self) -> bool:
        return bool(self.ranks("embedding"))

    def __repr__(self) -> str:
        lay = self.layout
        return (
            f"ProcessGrid(rank={self.global_rank}, tp={lay.tp}, cp={lay.cp}, dp={lay.dp}, "
            f"pp={lay.pp}, vpp={lay.vpp}, ep={lay.ep}, etp={lay.etp}, edp={lay.edp}, "
            f"order={lay.order!r}, backend={self.device_choice.backend!r})"
        )


_DEFAULT: ProcessGrid | None = None


def _init_default_process_group(choice: DeviceChoice, timeout: timedelta) -> None:
    missing = [
        v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"torch.distributed is not initialised and {', '.join(missing)} are not set; fix: "
            "launch with torchrun, or call torch.distributed.init_process_group first"
        )
    dist.init_process_group(backend=choice.backend, timeout=timeout)


def initialize_model_parallel(
    config: ParallelConfig | None = None, *, backend: str | None = None, set_default: bool = True
) -> ProcessGrid:
    """Create every group of `config` on this rank and return the grid.

    All validation happens before the first collective: a layout that cannot work raises
    `ParallelConfigError` on every rank alike. If torch.distributed is not yet initialised it
    is, from the torchrun environment, with the chosen backend (nccl on CUDA, else gloo).
    """
    config = config or ParallelConfig()
    choice = choose_backend(backend or (dist.get_backend() if dist.is_initialized() else None))
    if dist.is_initialized():
        world = dist.get_world_size()
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = config.resolve(world)
    grid_layout = GridLayout(layout)
    families = grid_layout.families  # validates expert/dense pipeline agreement, no comm
    device = bind_local_device(choice)
    if not dist.is_initialized():
        _init_default_process_group(choice, config.timeout)
    rank = dist.get_rank()
    groups: dict[str, Any] = {}
    for name in FAMILIES:
        # Every rank must call new_group for every group, in the same order.
        for ranks in families[name]:
            group = dist.new_group(ranks=ranks, timeout=config.timeout, backend=choice.backend)
            if rank in ranks:
                groups[name] = group
                comm.register_group_name(group, name)
    hierarchical = _hierarchical_cp_groups(grid_layout, rank, choice, config.timeout)
    host_group = _host_group(choice, config.timeout)
    grid = ProcessGrid(config, layout, grid_layout, rank, groups, choice, device, host_group)
    grid.hierarchical_cp_groups = hierarchical
    if set_default:
        global _DEFAULT
        _DEFAULT = grid
    return grid


def _hierarchical_cp_groups(
    grid: GridLayout, rank: int, choice: DeviceChoice, timeout: timedelta
) -> list[Any]:
    """Every level's groups made (collective: every rank, every group, one order); this
    rank's group of each level, named "hcp<level>" in collective errors."""
    mine = []
    for level, groups in enumerate(grid.hierarchical_cp):
        for ranks in groups:
            group = dist.new_group(ranks=ranks, timeout=timeout, backend=choice.backend)
            if rank in ranks:
                mine.append(group)
                comm.register_group_name(group, f"hcp{level}")
    return mine


def _host_group(choice: DeviceChoice, timeout: timedelta) -> Any:
    """The world on the host backend: the default group itself when that is already it
    (gloo), else one new group over every rank, named "host" in collective errors."""
    if choice.host_backend == choice.backend:
        return dist.group.WORLD
    group = dist.new_group(backend=choice.host_backend, timeout=timeout)
    comm.register_group_name(group, "host")
    return group


def destroy_model_parallel(grid: ProcessGrid | None = None) -> None:
    """Destroy the groups of `grid` (default: the default grid) and unset the default."""
    global _DEFAULT
    grid = grid or _DEFAULT
    if grid is None:
        return
    seen = set()
    for group in [*grid._groups.values(), *grid._twins.values(), *grid.hierarchical_cp_groups]:
        if id(group) in seen:
            continue
        seen.add(id(group))
        comm.forget_group(group)
        dist.destroy_process_group(group)
    grid._groups.clear()
    grid._twins.clear()
    grid.hierarchical_cp_groups = []
    host = grid.host_group
    if host is not None and host is not dist.group.WORLD and id(host) not in seen:
        comm.forget_group(host)
        dist.destroy_process_group(host)
    grid.host_group = None
    if grid is _DEFAULT:
        _DEFAULT = None


def shutdown(
    grid: ProcessGrid | None = None, *, default_group: bool = True, timeout: float | None = None
) -> bool:
    """The clean end of a process's distributed work: every process group destroyed, in
    order, and no collective worker thread left to outlive the interpreter.

    Destroys `grid`'s groups (default: the default grid's; families, then its host group),
    then every other group still named in `comm` (one a component made for itself, such as
    the async checkpoint writer's), then, with `default_group`, the default group,
    collecting garbage before and after. Without `default_group` (between the test
    harness's calls) nothing is collected: that costs ~0.1 s.

    Why: a gloo group's worker threads stop only when the last reference to the group goes
    (its destructor joins them). A worker that frees a finished collective's tensors while
    Python is shutting down dies in `take_gil`, and the process with it: `terminate called
    without an active exception`, SIGABRT, after a run that had finished. So call this
    once the objects that hold groups (models, optimizers, savers) are gone; DeviceMeshes
    made from the groups (FSDP2) are made to let go of them.

    Destroying a group waits for the collectives queued on it, which never end if another
    rank will not join them (after an error on this rank alone). `timeout` (seconds)
    bounds that wait: the work runs in a helper thread, and False is returned if it is not
    done by then (the caller should exit without Python's shutdown, `os._exit`). Returns
    True when everything was destroyed and, where threads can be listed (Linux), no gloo
    thread is left; `gloo_threads()` names any that are.
    """
    if timeout is None:
        _destroy_all(grid, default_group)
    else:
        worker = threading.Thread(
            target=_destroy_all, args=(grid, default_group), name="pentatron-shutdown", daemon=True
        )
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            return False
    return not (default_group and gloo_threads())


def _destroy_all(grid: ProcessGrid | None, default_group: bool) -> None:
    if "torch._dynamo" in sys.modules:
        _forget_compiled_code()
    if default_group:  # objects in reference cycles may still hold groups (~0.1 s: only at the end)
        _collect_all()
    destroy_model_parallel(grid)
    destroy_model_parallel()  # the default grid, if it is another one
    for group in list(comm._GROUP_NAMES):
        comm.forget_group(group)
        # ValueError: destroyed already, by an owner that did not forget its name
        with contextlib.suppress(ValueError):
            dist.destroy_process_group(group)
    if default_group and dist.is_initialized():
        _release_device_meshes()
        dist.destroy_process_group()  # the default group, and any unnamed group left
        _collect_all()


def _forget_compiled_code() -> None:
    """Code that torch.compile traced through a collective holds the group it was given
    (the traced graph keeps it as an example value), or the group's gloo threads outlive
    it (`--compile` on CPU warned at every exit). Dynamo keeps each compiled function twice:
    in its caches, which `reset()` clears, and as a global `__compiled_fn_<n>_<uuid>` of
    the module whose function it compiled, which `reset()` leaves. Both go: the global is
    set to None, not deleted, since Dynamo deletes the name itself once the compiled code
    is freed (and printed a KeyError per compiled function at exit when it was gone)."""
    torch._dynamo.reset()
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict):
            for name in [k for k in namespace if str(k).startswith("__compiled_fn_")]:
                namespace[name] = None


def _collect_all(passes: int = 5) -> None:
    """gc until a pass finds nothing: freeing one cycle can release C++ objects (autograd
    nodes) whose Python objects form the next one (full recomputation under --compile
    needed a second pass before its layers, and their groups, were gone)."""
    for _ in range(passes):
        if not gc.collect():
            return


def _release_device_meshes() -> None:
    """A DeviceMesh (FSDP2's, made from a grid group) holds its process groups, and DTensor
    keeps meshes in several caches for the life of the process: without this the groups
    of an FSDP2 run outlive it. Empties each live mesh's group registry instead of
    chasing the caches (torch-private; on a torch without it the thread check will tell)."""
    if "torch.distributed.device_mesh" not in sys.modules:
        return
    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():  # type(), not isinstance: no object's __class__ is asked
        if issubclass(type(obj), DeviceMesh):
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()


def gloo_threads() -> list[str]:
    """Names of this process's gloo threads (collective workers, transport loops) that are
    still alive; [] where threads cannot be listed (outside Linux)."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if "gloo" in name:
            names.append(name)
    return sorted(names)


def get_default_grid() -> ProcessGrid:
    if _DEFAULT is None:
        raise RuntimeError("no default grid: call initialize_model_parallel(config) first")
    return _DEFAULT


def model_parallel_is_initialized() -> bool:
    return _DEFAULT is not None
