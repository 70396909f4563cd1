"""Device and backend choice: cuda + nccl when a GPU is usable, else cpu + gloo.

One switch: the `backend` argument, else the PENTATRON_BACKEND environment variable
("nccl" or "gloo"), else auto-detection. A third pairing, meta + torch's fake process group
("meta:fake"), serves the dry run in `pentatron.parallel_state.testing.fake_device`: no
computation, no communication, and torch rejects a host tensor handed to a collective
exactly as NCCL does.

Each choice also names the host backend: the one a grid uses for its `host` group, where
host-side coordination (agreeing on flags, barriers around file writes, object broadcasts)
runs on CPU tensors. With gloo the compute group already is a host group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceChoice:
    backend: str  # the compute groups' backend
    device_type: str  # where model, batch, loss and collective tensors live
    host_backend: str = "gloo"  # the `host` group's backend (CPU tensors)


_CHOICES = {
    "nccl": DeviceChoice("nccl", "cuda", "gloo"),
    "gloo": DeviceChoice("gloo", "cpu", "gloo"),
    "meta:fake": DeviceChoice("meta:fake", "meta", "cpu:fake"),
}
_SELECTABLE = ("nccl", "gloo")  # what a user may ask for; the fake pairing is for tests


def _normalise(backend: str) -> str:
    """torch reports a mixed backend as "cpu:gloo,cuda:nccl": the device part decides."""
    if "cuda:nccl" in backend:
        return "nccl"
    return backend


def choose_backend(backend: str | None = None) -> DeviceChoice:
    chosen = backend or os.environ.get("PENTATRON_BACKEND") or None
    if chosen is None:
        chosen = "nccl" if torch.cuda.is_available() else "gloo"
    chosen = _normalise(chosen)
    if chosen not in _CHOICES:
        raise ValueError(
            f"backend={chosen!r}: known backends are {', '.join(_SELECTABLE)}; "
            "fix: pass backend='gloo' for CPU or 'nccl' for CUDA (or unset PENTATRON_BACKEND)"
        )
    if chosen == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, and torch sees no GPU; fix: use 'gloo'")
    return _CHOICES[chosen]


def current_device() -> torch.device:
    """The device this rank computes on: the default grid's, else the default process
    group's (cuda:<current> under NCCL, meta under the fake group), else the CPU."""
    from .grid import get_default_grid, model_parallel_is_initialized

    if model_parallel_is_initialized():
        return get_default_grid().device
    import torch.distributed as dist

    if dist.is_initialized():
        choice = choose_backend(dist.get_backend())
        if choice.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(choice.device_type)
    return torch.device("cpu")


def bind_local_device(choice: DeviceChoice) -> torch.device:
    """On CUDA, pin this process to GPU LOCAL_RANK (torchrun sets it); else the device type."""
    if choice.device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(choice.device_type)
