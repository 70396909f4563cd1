"""One call in a fresh process, forked from the harness's forkserver (torch imported).

    value = run_in_fresh_process(play, "tp2-pp2-dp2", 0)

For a test that must own the whole process: one that initialises its own default process
group (a fake world, a backend under test), patches modules for good (a planted bug) or
leaves state no later test may see. A `python script.py` subprocess gives the same
isolation but imports torch, DTensor and DCP again each time (~2.5 s of CPU before the
test's first line on these machines); a fork of the forkserver that serves the `distributed`
fixture's ranks starts with them imported (`pool.PRELOAD`) and frozen out of gc's scans.
Where the platform has no forkserver (Windows) the process is spawned.

The process is never left running: it is joined (or killed) before the call returns or raises.
The function travels by (source file, qualified name), as for the rank pools; arguments and
the return value are pickled. The process runs with one intra-op thread and the given
environment additions, and exits without the interpreter's teardown once it has answered.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from .pool import RankError, RankTimeoutError, _call, _context, _function_ref, _start_child


def run_in_fresh_process(
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> Any:
    """`fn(*args, **kwargs)` in a new process; its return value.

    Raises `RankError` with the process's traceback if `fn` raised or the process died
    before answering (with its exit code), and `RankTimeoutError` if it did not answer
    within `timeout` seconds (the process is killed first).
    """
    path, qualname = _function_ref(fn)
    ctx = _context()
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_child,
        args=(sender, path, qualname, args, kwargs, list(sys.path), dict(env or {})),
        daemon=False,  # it may start processes of its own (the app's data workers, writers)
        name=f"pentatron-fresh-{qualname}",
    )
    proc.start()
    sender.close()  # the child holds the only writing end: EOF when it dies
    answered = False
    try:
        ok, value = _answer(receiver, proc, qualname, timeout)
        answered = True
    finally:
        receiver.close()
        if answered:
            proc.join(10)  # it exits right after answering
        if proc.is_alive():  # no answer (timeout, an interrupt here) or stuck in its exit:
            proc.kill()  # a non-daemon child left running would hold up the caller's exit
        proc.join(10)
    if not ok:
        raise RankError(f"{qualname} failed in a fresh process:\n{value.rstrip()}")
    return value


def _answer(receiver: Any, proc: Any, qualname: str, timeout: float) -> tuple[bool, Any]:
    """The child's (ok, value), or the error saying why there is none."""
    if not receiver.poll(timeout):
        raise RankTimeoutError(
            f"{qualname} in a fresh process: no answer within {timeout:.0f} s; killed"
        )
    try:
        return receiver.recv()
    except EOFError:  # its end of the pipe closed with nothing sent: it died
        proc.join(10)
        raise RankError(
            f"{qualname} in a fresh process: it died before answering (exit code {proc.exitcode})"
        ) from None


def _child(
    sender: Any,
    path: str,
    qualname: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    sys_path: list[str],
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    _start_child(sys_path)
    ok, value = _call(path, qualname, args, kwargs)
    try:
        sender.send((ok, value))
    except Exception:
        sender.send((False, "the result could not be sent back:\n" + traceback.format_exc()))
    sender.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Answered: skip the interpreter's teardown (~1 s of CPU with torch loaded); whatever
    # the call left behind (process groups, patched modules) ends with the process.
    os._exit(0)
