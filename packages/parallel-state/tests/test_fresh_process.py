"""`run_in_fresh_process`: a new process per call, forked from the harness's forkserver,
that answers, reports failures with their traceback, and is killed past its timeout."""

import multiprocessing
import os
import sys
import time

import pytest

from pentatron.parallel_state.testing import RankError, RankTimeoutError, run_in_fresh_process

_STATE: list[str] = []


def _facts(tag, env_key=None):
    import gc

    import torch

    from pentatron.parallel_state.testing import pool

    before = list(_STATE)
    _STATE.append(tag)  # seen by a later call only if it ran in the same process
    return {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "seen": before,
        "env": os.environ.get(env_key) if env_key else None,
        "threads": torch.get_num_threads(),
        "preloaded": all(m in sys.modules for m in pool.PRELOAD),
        "frozen": gc.get_freeze_count(),
    }


def _raise(message):
    raise ValueError(message)


def _die(code):
    os._exit(code)


def _sleep(seconds, pid_file=None):
    if pid_file:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
    time.sleep(seconds)
    return "woke"


def _gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie waiting for its parent, the server)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return True


def _big(n):
    return bytes(n)


def test_each_call_is_a_new_process_with_the_callers_arguments_and_env():
    env = {"PENTATRON_FRESH_TEST": "1"}
    first = run_in_fresh_process(_facts, "a", env_key="PENTATRON_FRESH_TEST", env=env)
    second = run_in_fresh_process(_facts, tag="b")
    assert first["pid"] != second["pid"] and os.getpid() not in (first["pid"], second["pid"])
    assert first["seen"] == [] and second["seen"] == []  # nothing carried from call to call
    assert first["env"] == "1" and "PENTATRON_FRESH_TEST" not in os.environ
    assert first["threads"] == 1


@pytest.mark.skipif(
    "forkserver" not in multiprocessing.get_all_start_methods(),
    reason="no forkserver on this platform (the process is spawned)",
)
def test_forked_from_the_server_that_imported_torch():
    facts = run_in_fresh_process(_facts, "x")
    assert facts["ppid"] != os.getpid()  # the forkserver's child, not the test's
    assert facts["preloaded"]
    assert facts["frozen"] > 100_000  # torch's objects, frozen out of gc's scans


def _start_method():
    import multiprocessing

    return multiprocessing.get_start_method()


def test_processes_it_starts_use_pythons_default_start_method(distributed):
    """A forkserver's children inherit "forkserver" as their default start method: a
    DataLoader's workers in the call then went to a second server, started without torch
    (~1.4 s a worker). The call and the ranks start processes as `python` would."""
    import subprocess

    code = "import multiprocessing as m; print(m.get_start_method())"
    python_default = subprocess.check_output([sys.executable, "-c", code], text=True).strip()
    assert run_in_fresh_process(_start_method) == python_default
    assert distributed.run(2, _start_method) == [python_default] * 2


def test_a_raise_comes_back_with_its_traceback():
    with pytest.raises(RankError, match=r"(?s)_raise failed in a fresh process.*ValueError: boom"):
        run_in_fresh_process(_raise, "boom")


def test_a_death_names_the_exit_code():
    with pytest.raises(RankError, match=r"died before answering \(exit code 7\)"):
        run_in_fresh_process(_die, 7)


def test_past_the_timeout_it_is_killed(tmp_path):
    start = time.monotonic()
    pid_file = tmp_path / "pid"
    with pytest.raises(RankTimeoutError, match="no answer within 1 s; killed"):
        run_in_fresh_process(_sleep, 60, str(pid_file), timeout=1.0)
    assert time.monotonic() - start < 30  # not the sleep's 60 s
    if os.path.isdir("/proc"):
        assert _gone(int(pid_file.read_text()))


def test_a_large_result_comes_back_whole():
    # bigger than a pipe's buffer: the child blocks in send until the parent reads
    assert run_in_fresh_process(_big, 5_000_000) == bytes(5_000_000)


def test_functions_must_be_module_level():
    def local():
        return 1

    with pytest.raises(ValueError, match="module level"):
        run_in_fresh_process(local)
