"""Per-rank RNG states as tensors (`rng/<global rank>/<source>`), restored at the same layout.

Sources: python `random` (`python` int64 [625] + `python_meta` float64 [3]: version,
has_gauss, gauss), numpy's global MT19937 (`numpy` int64 [624] + `numpy_meta` float64 [3]:
pos, has_gauss, gauss), torch CPU (`torch` uint8), CUDA when available (`cuda` uint8) and
each state of the model-parallel tracker (`tracker/<name>` uint8). Each rank writes only
its own keys, so nothing is shared or deduplicated.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from pentatron.tp_layers import get_rng_tracker

PREFIX = "rng/"


def _floats(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def capture_rng(rank: int) -> dict[str, torch.Tensor]:
    """This rank's RNG states under `rng/<rank>/...`."""
    head = f"{PREFIX}{rank}/"
    version, internal, gauss = random.getstate()
    numpy_state = np.random.get_state()
    if not isinstance(numpy_state, tuple):  # a dict when the generator is not MT19937
        raise TypeError(
            "numpy's global generator is not MT19937; RNG checkpoints hold MT19937 states only"
        )
    _, keys, pos, has_gauss, cached = numpy_state
    sd = {
        head + "python": torch.tensor(internal, dtype=torch.int64),
        head + "python_meta": _floats(version, gauss is not None, gauss or 0.0),
        head + "numpy": torch.from_numpy(keys.astype(np.int64)),
        head + "numpy_meta": _floats(pos, has_gauss, cached),
        head + "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        sd[head + "cuda"] = torch.cuda.get_rng_state().cpu()
    for name, state in get_rng_tracker().get_states().items():
        sd[f"{head}tracker/{name}"] = state.cpu()
    return sd


def rng_load_entries(rank: int, saved: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Receiving tensors for this rank's saved RNG keys (`saved`: the DCP metadata)."""
    head = f"{PREFIX}{rank}/"
    return {
        k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for k, md in saved.items()
        if k.startswith(head)
    }


def restore_rng(rank: int, sd: dict[str, torch.Tensor]) -> None:
    """Set the generators from `rng_load_entries`' tensors after the load."""
    head = f"{PREFIX}{rank}/"
    version, has_gauss, gauss = sd[head + "python_meta"].tolist()
    internal = tuple(int(v) for v in sd[head + "python"].tolist())
    random.setstate((int(version), internal, gauss if has_gauss else None))
    pos, np_has_gauss, cached = sd[head + "numpy_meta"].tolist()
    keys = sd[head + "numpy"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, int(pos), int(np_has_gauss), cached))
    torch.set_rng_state(sd[head + "torch"])
    if torch.cuda.is_available() and head + "cuda" in sd:
        torch.cuda.set_rng_state(sd[head + "cuda"])
    tracker_head = head + "tracker/"
    states = {k[len(tracker_head) :]: v for k, v in sd.items() if k.startswith(tracker_head)}
    if states:  # CPU byte tensors for either device type, as torch's setters take them
        get_rng_tracker().set_states(states)
