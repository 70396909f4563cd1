"""One subprocess of a device check: its own session, environment, port and timeout, its
output streamed into the one combined log, its `RESULT {json}` lines collected.

A step that runs past its timeout is sent SIGTERM, then SIGKILL 5 s later, as a whole
process group (torch.compile's worker processes included), and is reported as timed out;
nothing of it is left running. Only the standard library: run_all.py imports no torch.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import _paths

STEP_LOG_CAP = 2 << 20  # bytes of one step's output kept in the log; then only its tail
TAIL_LINES = 60


def free_port() -> int:
    """A TCP port nobody listens on right now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment, plus the repository sources on PYTHONPATH, unbuffered
    output, the Hugging Face libraries offline (the GPU machine has no network), and a
    world of one (RANK/WORLD_SIZE/LOCAL_RANK, MASTER_ADDR and a free MASTER_PORT) for code
    that creates a process group without torchrun."""
    env = dict(os.environ)
    env.update(
        PYTHONPATH=_paths.pythonpath(os.environ.get("PYTHONPATH")),
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    env.update(extra or {})
    return env


class CombinedLog:
    """The one log file of a run_all invocation; each step gets a titled section."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = open(path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        with self._lock:
            self._f.write(text)
            self._f.flush()

    def close(self) -> None:
        self._f.close()


@dataclass
class StepResult:
    label: str
    argv: list[str]
    rc: int | None = None  # None: never started
    seconds: float = 0.0
    timed_out: bool = False
    tail: list[str] = field(default_factory=list)
    results: list[dict] = field(default_factory=list)  # parsed `RESULT {json}` lines

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out

    def result(self) -> dict:
        """The last RESULT object ({} if none)."""
        return self.results[-1] if self.results else {}

    def error_line(self) -> str:
        """The most telling line of a failed step: the last exception line, else the last."""
        for line in reversed(self.tail):
            s = line.strip()
            if s and (s.split(":")[0].endswith(("Error", "Exception")) or "error:" in s):
                return s
        return next((x.strip() for x in reversed(self.tail) if x.strip()), "")


def run_step(
    label: str,
    argv: list[str],
    log: CombinedLog,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path = _paths.REPO,
) -> StepResult:
    """Run `argv` to completion or `timeout` seconds; everything it prints goes to `log`."""
    res = StepResult(label, list(argv))
    log.write(f"\n===== {label} (timeout {timeout:.0f} s) =====\n$ {' '.join(argv)}\n")
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env if env is not None else step_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
        errors="replace",
        bufsize=1,
    )
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    state = {"bytes": 0, "cut": 0}

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line)
            if line.startswith("RESULT "):
                with contextlib.suppress(json.JSONDecodeError):
                    res.results.append(json.loads(line[len("RESULT ") :]))
            if state["bytes"] < STEP_LOG_CAP:
                state["bytes"] += len(line)
                log.write(line)
            else:
                state["cut"] += 1

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        res.rc = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        res.timed_out = True
        _kill_group(proc)
        res.rc = proc.returncode
    _kill_leftovers(proc)
    reader.join(timeout=10)
    res.seconds = time.monotonic() - start
    res.tail = list(tail)
    if state["cut"]:
        log.write(f"[... {state['cut']} lines over the log cap left out; the last ones:]\n")
        log.write("".join(res.tail[-20:]))
    verdict = "TIMED OUT" if res.timed_out else f"exit {res.rc}"
    log.write(f"----- {label}: {verdict} after {res.seconds:.1f} s -----\n")
    return res


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the step's process group, SIGKILL it 5 s later if it is still there."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _kill_leftovers(proc: subprocess.Popen) -> None:
    """Whatever the finished step left running in its session (e.g. compile workers)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def python() -> str:
    """The interpreter running run_all.py (python3 on the GPU machine)."""
    return sys.executable or "python3"
