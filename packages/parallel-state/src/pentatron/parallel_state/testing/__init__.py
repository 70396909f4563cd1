"""Multi-process test harness: run a function on N gloo ranks in persistent workers.

`run_distributed(world_size, fn, *args)` uses a process-wide `PoolSet`; under pytest use the
`distributed` fixture (plugin registered through the `pytest11` entry point).
`fake_device`: one process playing any rank of a world on a fake GPU (`fake_world`,
`FakeDevice`), for CPU tests of device discipline. `run_in_fresh_process(fn, *args)`: one
call in a new process forked from the ranks' forkserver, for a test that must own its process.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from typing import Any

from .fake_device import DeviceDisciplineError, FakeDevice, fake_world
from .fresh import run_in_fresh_process
from .pool import PoolSet, RankError, RankPool, RankTimeoutError

_DEFAULT_POOLS: PoolSet | None = None


def default_pools() -> PoolSet:
    global _DEFAULT_POOLS
    if _DEFAULT_POOLS is None:
        _DEFAULT_POOLS = PoolSet()
        atexit.register(_DEFAULT_POOLS.close)
    return _DEFAULT_POOLS


def run_distributed(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return each rank's result."""
    return default_pools().run(world_size, fn, *args, timeout=timeout, **kwargs)


__all__ = [
    "DeviceDisciplineError",
    "FakeDevice",
    "PoolSet",
    "RankError",
    "RankPool",
    "RankTimeoutError",
    "default_pools",
    "fake_world",
    "run_distributed",
    "run_in_fresh_process",
]
