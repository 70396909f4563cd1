"""Persistent pools of gloo worker processes that run a function on every rank.

A pool of N processes is spawned once, joins one gloo process group of size N, and then
serves calls: `pool.run(fn, *args)` runs `fn(*args)` on every rank and returns the list of
results, rank-ordered. Functions travel by (source file, qualified name), so test functions
of any test module work under pytest's importlib mode; arguments and results are pickled
between these trusted child processes.

Failures: if a rank raises, the others get a grace period to finish, then the pool is torn
down (its collectives may be out of step) and `RankError` carries the failing rank's
traceback. A rank that exceeds the call timeout or dies is killed with the whole pool, and
`RankTimeoutError` names the ranks that did not answer. The next call spawns a fresh pool.

Start-up: where the platform has it (Linux, macOS), ranks are forked by multiprocessing's
forkserver, which imports torch once (`PRELOAD`); each rank, a fork of it, freezes what
start-up imported out of the garbage collector's scans. Spawning imported torch once per rank:
~2 s of CPU each, ~6 s of wall time for a pool of 8 on 2 cores, paid again at every
respawn. Where forkserver is missing (Windows) ranks are spawned.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import inspect
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

_GRACE_S = 5.0  # how long healthy ranks may keep running after another rank failed
# Imported once by the forkserver, inherited by every rank it forks. Only modules whose
# import starts no thread (checked: the server has one thread; a fork copies only the
# calling one): torch's intra-op pool and gloo's threads start later, in the rank. DCP and
# DTensor (~1.1 s of import a rank) serve every package that checkpoints or shards.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    __name__,
)


class RankError(AssertionError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


class RankTimeoutError(AssertionError):
    """Ranks did not answer within the timeout (hung or died); the pool was killed."""


def _function_ref(fn: Callable[..., Any]) -> tuple[str, str]:
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"{qualname}: functions run on ranks must be defined at module level "
            "(they are looked up by file and name in the worker processes)"
        )
    return os.path.abspath(inspect.getfile(fn)), qualname


_MODULES: dict[str, Any] = {}


def _resolve(path: str, qualname: str) -> Callable[..., Any]:
    module = _MODULES.get(path)
    if module is None:
        name = "pentatron_rank_fn_" + str(abs(hash(path)))
        existing = [
            m
            for m in list(sys.modules.values())
            if getattr(m, "__file__", None) and os.path.abspath(str(m.__file__)) == path
        ]
        if existing:
            module = existing[0]
        else:
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec and spec.loader, path
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        _MODULES[path] = module
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _start_child(sys_path: list[str]) -> None:
    """What every process the harness forks (a rank, a fresh process) does first: the
    caller's `sys.path`; multiprocessing's default start method as a process that `python`
    or torchrun started has it (the server's children inherit "forkserver": a process the
    call started, such as a DataLoader's worker, went to a second server of its own,
    started on demand without torch, ~1.4 s per worker instead of a fork); what start-up
    imported frozen out of every later gc scan (a final shutdown's collections scanned
    torch's whole heap, ~0.4 s a rank); one intra-op thread (ranks share a few cores)."""
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    mp.set_start_method(None, force=True)  # the platform's default again, chosen on use
    import torch

    gc.freeze()
    torch.set_num_threads(1)


def _call(
    path: str, qualname: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[bool, Any]:
    """(True, what the function returned) or (False, the traceback of what it raised)."""
    try:
        return True, _resolve(path, qualname)(*args, **kwargs)
    except BaseException:
        return False, traceback.format_exc()


def _after_call() -> None:
    """Leave no state behind for the next test on this rank: the app's clean shutdown,
    except for the default group, which the worker keeps for its next call."""
    from .. import comm
    from ..grid import shutdown

    shutdown(default_group=False)
    comm._ACTIVE.clear()


def _worker(
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    tasks: Any,
    results: Any,
    sys_path: list[str],
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PENTATRON_BACKEND="gloo",
    )
    _start_child(sys_path)
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s)
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    results.put((rank, -1, True, os.getpid()))
    while True:
        task = tasks.get()
        if task is None:
            break
        call_id, path, qualname, args, kwargs = task
        ok, value = _call(path, qualname, args, kwargs)
        try:
            _after_call()
        except BaseException:
            if ok:
                value, ok = "cleanup after the call failed:\n" + traceback.format_exc(), False
        try:
            results.put((rank, call_id, ok, value))
        except Exception:
            results.put(
                (rank, call_id, False, "result could not be sent back:\n" + traceback.format_exc())
            )
    from ..grid import shutdown

    # As the app ends: every group destroyed and no gloo thread left at exit; exit status
    # 3 if one is (a call kept a group alive, which could abort the interpreter's exit).
    if not shutdown():
        sys.exit(3)
    # Clean: skip the interpreter's teardown, which costs a worker holding torch and the
    # app's modules a second or more of CPU (the session's end waited ~15 s on 2 cores for
    # pretrain's pools). The results queue is flushed first; nothing else is buffered.
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankPool:
    """`world_size` persistent gloo ranks (spawned on first use)."""

    def __init__(self, world_size: int, timeout: float = 120.0, collective_timeout: float = 60.0):
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: must be >= 1")
        self.world_size = world_size
        self.timeout = timeout
        self.collective_timeout = collective_timeout
        self._procs: list[Any] = []
        self._call_id = 0
        self.spawn_count = 0

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self) -> None:
        import torch.distributed as dist

        self.close()
        ctx = _context()
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            self.world_size + 1,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.collective_timeout),
        )
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with _environ(env):
            self._procs = [
                ctx.Process(
                    target=_worker,
                    daemon=True,
                    name=f"pentatron-rank{r}",
                    args=(
                        r,
                        self.world_size,
                        self._store.port,
                        self.collective_timeout,
                        self._tasks[r],
                        self._results,
                        list(sys.path),
                    ),
                )
                for r in range(self.world_size)
            ]
            for p in self._procs:
                p.start()
        self.spawn_count += 1
        self._collect(-1, self.timeout, what="start-up")

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; return the results in rank order."""
        path, qualname = _function_ref(fn)
        if not self.alive:
            self.start()
        self._call_id += 1
        for q in self._tasks:
            q.put((self._call_id, path, qualname, args, kwargs))
        return self._collect(self._call_id, timeout or self.timeout, what=qualname)

    def _collect(self, call_id: int, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        done: dict[int, tuple[bool, Any]] = {}
        while len(done) < self.world_size:
            failed = [r for r, (ok, _) in done.items() if not ok]
            if failed:
                deadline = min(deadline, time.monotonic() + _GRACE_S)
            try:
                rank, cid, ok, value = self._results.get(timeout=0.05)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in done]
                if dead or time.monotonic() > deadline:
                    self._fail_hung(what, timeout, done, dead)
                continue
            if cid == call_id:
                done[rank] = (ok, value)
        failures = {r: v for r, (ok, v) in done.items() if not ok}
        if failures:
            # All ranks answered, so collectives are in step: the pool stays usable.
            raise RankError(_format_failures(what, failures, self.world_size))
        return [done[r][1] for r in range(self.world_size)]

    def _fail_hung(
        self, what: str, timeout: float, done: dict[int, tuple[bool, Any]], dead: list[int]
    ) -> None:
        missing = [r for r in range(self.world_size) if r not in done]
        codes = {r: self._procs[r].exitcode for r in dead}
        self.close(kill=True)
        failures = {r: v for r, (ok, v) in done.items() if not ok}
        lines = [
            f"{what} on {self.world_size} ranks: rank(s) {missing} did not answer "
            f"({'died with exit codes ' + str(codes) if dead else f'over {timeout:.0f} s'});"
            " the pool was killed and will be respawned"
        ]
        if failures:
            lines.append("first, these ranks failed (the likely cause):")
            lines.append(_format_failures(what, failures, self.world_size))
        raise RankTimeoutError("\n".join(lines))

    def close(self, kill: bool = False) -> list[int | None]:
        """End the ranks; their exit statuses (0: clean; 3: a gloo thread outlived the
        shutdown, see `_worker`; [] if none were running)."""
        if not kill:
            self._ask_to_stop()
        return self._reap(wait=not kill)

    def _ask_to_stop(self) -> None:
        """Each rank ends its loop, shuts its groups down and exits (not waited for here)."""
        if not self._procs:  # never started (no task queues) or already closed
            return
        for q in self._tasks:
            with contextlib.suppress(Exception):
                q.put(None)

    def _reap(self, wait: bool = True) -> list[int | None]:
        """Wait for the ranks to exit (with `wait`, 10 s each), killing any still alive."""
        for p in self._procs if wait else []:
            p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        codes = [p.exitcode for p in self._procs]
        self._procs = []
        return codes


def _context() -> Any:
    """multiprocessing's forkserver, preloading `PRELOAD` (see the module's docstring), or
    spawn where the platform has no forkserver."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Only read when the server starts (the first pool of this process); later pools reuse it.
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _format_failures(what: str, failures: dict[int, str], world_size: int) -> str:
    parts = [f"{what} failed on rank(s) {sorted(failures)} of {world_size}:"]
    for r in sorted(failures):
        parts.append(f"--- rank {r} ---\n{failures[r].rstrip()}")
    return "\n".join(parts)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Any:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class PoolSet:
    """One `RankPool` per world size, created on demand and reused."""

    def __init__(self, timeout: float = 120.0, collective_timeout: float = 60.0) -> None:
        self.timeout, self.collective_timeout = timeout, collective_timeout
        self._pools: dict[int, RankPool] = {}

    def pool(self, world_size: int) -> RankPool:
        if world_size not in self._pools:
            self._pools[world_size] = RankPool(world_size, self.timeout, self.collective_timeout)
        return self._pools[world_size]

    def run(
        self,
        world_size: int,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        return self.pool(world_size).run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> dict[int, list[int | None]]:
        """End every pool; the ranks' exit statuses by world size (see `RankPool.close`)."""
        # Every pool's ranks are told first, so their shutdowns overlap.
        for p in self._pools.values():
            p._ask_to_stop()
        codes = {w: p._reap() for w, p in self._pools.items()}
        self._pools.clear()
        return codes
