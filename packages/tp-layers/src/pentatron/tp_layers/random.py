"""Model-parallel RNG: named generator states to fork into, on CPU or CUDA.

Inside a tensor-parallel region each rank holds a different shard of an activation, so its
dropout mask must differ from the other tp ranks' (else the masks of the shards are
correlated); outside, activations are replicated over tp and the mask must be the same on
every tp rank. `model_parallel_seed(seed, grid)` arranges both:

- the default generator gets `seed` (same on every rank of a tp and dp group: replicated
  regions agree),
- the tracker's "model-parallel-rng" state gets `seed + 2718 + tp_rank` (different per tp
  rank, same across dp), used as `with get_rng_tracker().fork(): dropout(x)`,
- "expert-parallel-rng" gets `seed + 1024 + 100 * ep_rank + etp_rank`, and
  "data-parallel-rng" gets `seed` (Megatron's offsets).

Pipeline stages usually add `100 * pp_rank` to `seed` before calling this (the app's job).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
EXPERT_PARALLEL_RNG = "expert-parallel-rng"
DATA_PARALLEL_RNG = "data-parallel-rng"


def default_rng_device() -> str:
    """Where dropout draws from by default: "cuda" when a GPU is usable, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_rng_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _seeded_state(seed: int, device_type: str) -> torch.Tensor:
    """The default generator's state after `manual_seed(seed)`, without changing it."""
    if device_type == "cuda":
        saved = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(seed)
        state = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(saved)
        return state
    return torch.Generator().manual_seed(seed).get_state()


class RNGStatesTracker:
    """Named RNG states of one device type; `fork(name)` swaps one in for a block.

    Megatron's `CudaRNGStatesTracker`, for CPU as well (`device_type="cpu"`).
    """

    def __init__(self, device_type: str | None = None) -> None:
        self.device_type = device_type or default_rng_device()
        self.reset()

    def reset(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the states (for checkpointing / recomputation)."""
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Register state `name` seeded with `seed`; names and seeds must be unique."""
        if seed in self.seeds:
            raise ValueError(
                f"seed {seed} already registered in the RNG tracker; the rule: "
                "each named state has its own seed; fix: choose another seed"
            )
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists; fix: reset() the tracker")
        self.seeds.add(seed)
        self.states[name] = _seeded_state(seed, self.device_type)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from state `name` inside the block; the default generator is untouched."""
        if name not in self.states:
            raise KeyError(
                f"RNG state {name!r} is not registered; known: {sorted(self.states)};"
                " fix: call model_parallel_seed(seed, grid) first"
            )
        outside = get_rng_state(self.device_type)
        set_rng_state(self.states[name], self.device_type)
        try:
            yield
        finally:
            self.states[name] = get_rng_state(self.device_type)
            set_rng_state(outside, self.device_type)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (Megatron's `get_cuda_rng_tracker`)."""
    return _TRACKER


get_cuda_rng_tracker = get_rng_tracker


def _ranks_from(
    grid: Any, tp_rank: int | None, ep_rank: int | None, etp_rank: int | None
) -> tuple[int, int, int]:
    if tp_rank is not None:
        return tp_rank, ep_rank or 0, etp_rank or 0
    if grid is None:
        from pentatron.parallel_state import get_default_grid

        grid = get_default_grid()
    return grid.rank("tp"), grid.rank("ep"), grid.rank("etp")


def model_parallel_seed(
    seed: int,
    grid: Any = None,
    *,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    tracker: RNGStatesTracker | None = None,
) -> RNGStatesTracker:
    """Seed the default generator and the tracker's states (see the module docstring).

    Ranks come from `grid` (a ProcessGrid; default: the default grid) unless `tp_rank`
    (and optionally `ep_rank`, `etp_rank`) are given, e.g. by a user with their own groups.
    """
    tp_r, ep_r, etp_r = _ranks_from(grid, tp_rank, ep_rank, etp_rank)
    tracker = tracker or _TRACKER
    torch.manual_seed(seed)  # CPU and every CUDA device
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_r)
    tracker.add(EXPERT_PARALLEL_RNG, seed + 1024 + 100 * ep_r + etp_r)
    tracker.add(DATA_PARALLEL_RNG, seed)
    return tracker


model_parallel_cuda_manual_seed = model_parallel_seed
