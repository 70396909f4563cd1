"""Device and backend choice: cuda + nccl when a GPU is usable, else cpu + gloo.

One switch: the `backend` argument, else the PENTATRON_BACKEND environment variable
("nccl" or "gloo"), else auto-detection.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

_BACKEND_DEVICE = {"nccl": "cuda", "gloo": "cpu"}


@dataclass(frozen=True)
class DeviceChoice:
    backend: str
    device_type: str


def choose_backend(backend: str | None = None) -> DeviceChoice:
    chosen = backend or os.environ.get("PENTATRON_BACKEND") or None
    if chosen is None:
        chosen = "nccl" if torch.cuda.is_available() else "gloo"
    if chosen not in _BACKEND_DEVICE:
        raise ValueError(
            f"backend={chosen!r}: known backends are {', '.join(_BACKEND_DEVICE)}; "
            "fix: pass backend='gloo' for CPU or 'nccl' for CUDA (or unset PENTATRON_BACKEND)"
        )
    if chosen == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, and torch sees no GPU; fix: use 'gloo'")
    return DeviceChoice(backend=chosen, device_type=_BACKEND_DEVICE[chosen])


def current_device() -> torch.device:
    """The device this rank computes on, following the backend of the default process group."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def bind_local_device(choice: DeviceChoice) -> torch.device:
    """On CUDA, pin this process to GPU LOCAL_RANK (torchrun sets it); CPU needs nothing."""
    if choice.device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
