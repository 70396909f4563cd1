"""Acceptance (faults and exits), with real processes: torchrun with 2 workers (pp2).

- SIGTERM to the workers mid-run (what Slurm and torchrun send on preemption) makes every
  rank finish its iteration, save a checkpoint and exit 0; the next run resumes from that
  iteration and stops at --exit-interval, exit 0.
- A worker SIGKILLed in the middle of a save leaves the previous checkpoint as latest, and
  the next run loads it.
- The normal end with the async checkpoint writer still busy at the last iteration, and
  --exit-duration-in-mins: exit 0 and a complete checkpoint.
- A NaN loss: exit status 3, one line, the async save before it published. An error on
  one rank: a traceback and a non-zero exit, promptly.

Every launch runs in its own session: no process of it may outlive torchrun, and no rank
may print `terminate called` (a gloo thread aborting the interpreter's exit) or the app's
warning about threads of destroyed groups. Faults are planted by `_faulty_app.py`.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

FAULTY = str(Path(__file__).with_name("_faulty_app.py"))
ARGS = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--max-position-embeddings",
    "16",
    "--micro-batch-size",
    "2",
    "--lr",
    "1e-3",
    "--mock-data",
    "--vocab-size",
    "256",
    "--make-vocab-size-divisible-by",
    "32",
    "--eval-iters",
    "0",
    "--log-interval",
    "1",
    "--no-progress",
    "--pipeline-model-parallel-size",
    "2",
    "--global-batch-size",
    "4",
]


def _torchrun(extra: list[str], entry=("-m", "pentatron.pretrain"), env=None, **kwargs):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        *entry,
        *ARGS,
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,  # every process it starts can be found: see _finish
        **kwargs,
    )


def _session(sid: int) -> list[int]:
    """The live processes of session `sid` (zombies excluded)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            state, _, _, session = entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):
            continue
        if int(session) == sid and state != "Z":
            pids.append(int(entry.name))
    return pids


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    """The launch's output, once torchrun has exited; asserts that it left no process and
    that no rank aborted at exit or kept threads of destroyed groups."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        stray = _session(proc.pid)
        for pid in stray:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not stray, f"processes left behind: {stray}\n{out[-3000:]}"
    assert "terminate called" not in out, out[-3000:]
    assert "pentatron-pretrain: warning" not in out, out[-3000:]
    return out


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _wait_for_line(proc: subprocess.Popen, pattern: str, limit_s: float = 240) -> list[str]:
    lines, deadline = [], time.monotonic() + limit_s
    for line in proc.stdout:
        lines.append(line)
        if re.search(pattern, line):
            return lines
        assert time.monotonic() < deadline, "".join(lines[-20:])
    raise AssertionError("run ended before " + pattern + ":\n" + "".join(lines[-30:]))


def test_sigterm_saves_exits_zero_and_resumes(tmp_path):
    from pentatron.pretrain.checkpointing import read_latest_iteration

    save = str(tmp_path / "ckpt")
    proc = _torchrun(["--train-iters", "100000", "--save", save, "--exit-signal-handler"])
    lines = _wait_for_line(proc, r"iteration\s+3/")
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
    log = "".join(lines) + _finish(proc)
    assert proc.returncode == 0, log[-3000:]
    latest = read_latest_iteration(save)
    assert latest is not None and latest >= 3, log[-2000:]
    assert f"done: {latest} iterations (signal)" in log

    # Same --train-iters (the schedule is checked against the checkpoint's, as Megatron
    # does); --exit-interval stops the resumed run two iterations later.
    resumed = _torchrun(
        [
            "--train-iters",
            "100000",
            "--exit-interval",
            str(latest + 2),
            "--load",
            save,
            "--save",
            save,
        ]
    )
    out = _finish(resumed)
    assert resumed.returncode == 0, out[-3000:]
    assert f"done: {latest + 2} iterations (exit-interval)" in out, out[-2000:]
    its = [int(m) for m in re.findall(r"iteration\s+(\d+)/", out)]
    assert its == [latest + 1, latest + 2], out[-2000:]
    assert read_latest_iteration(save) == latest + 2


def _checkpoint_entries(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(("iter_", "latest")))


def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path):
    from pentatron.pretrain.checkpointing import read_latest_iteration

    save = str(tmp_path / "ckpt")
    flags = ["--train-iters", "4", "--save-interval", "2", "--save", save]
    proc = _torchrun(flags, entry=(FAULTY,), env={"KILL_SAVE_DIR": "iter_0000004.tmp"})
    out, _ = proc.communicate(timeout=240)
    assert not _session(proc.pid), "a rank outlived the job"
    assert proc.returncode != 0, out[-3000:]  # the job died
    assert read_latest_iteration(save) == 2, out[-3000:]
    assert _checkpoint_entries(save) == [
        "iter_0000002",
        "iter_0000004.tmp",  # the half-written save, never made visible
        "latest_checkpointed_iteration.txt",
    ]
    partial = os.listdir(os.path.join(save, "iter_0000004.tmp"))
    assert any(f.endswith(".distcp") for f in partial) and ".metadata" not in partial, partial
    resumed = _torchrun(["--train-iters", "4", "--load", save, "--save", save])
    out = _finish(resumed)
    assert resumed.returncode == 0, out[-3000:]
    its = [int(m) for m in re.findall(r"iteration\s+(\d+)/", out)]
    assert its == [3, 4], out[-2000:]
    assert read_latest_iteration(save) == 4
    assert _checkpoint_entries(save) == [
        "iter_0000002",
        "iter_0000004",
        "latest_checkpointed_iteration.txt",
    ]


def _complete(save: str, iteration: int) -> bool:
    """The checkpoint of `iteration` is published, has its metadata, and nothing is left
    half-written."""
    folder = os.path.join(save, f"iter_{iteration:07d}")
    tmp = [n for n in os.listdir(save) if n.endswith(".tmp")]
    return os.path.exists(os.path.join(folder, ".metadata")) and not tmp


def test_async_writer_busy_at_the_last_iteration_exits_zero(tmp_path):
    from pentatron.pretrain.checkpointing import read_latest_iteration

    save = str(tmp_path / "ckpt")
    flags = ["--train-iters", "3", "--save", save, "--save-interval", "1", "--async-save"]
    flags += ["--num-workers", "1"]  # data-loader worker processes must end too
    proc = _torchrun(flags, entry=(FAULTY,), env={"SLOW_SAVE_DIR": "iter_0000003.tmp"})
    out = _finish(proc)
    assert proc.returncode == 0, out[-3000:]
    written = out.index("slow write of iter_0000003.tmp finished")
    assert written < out.index("done: 3 iterations (train-iters)"), out[-2000:]
    assert read_latest_iteration(save) == 3 and _complete(save, 3), os.listdir(save)


def test_exit_duration_saves_and_exits_zero(tmp_path):
    from pentatron.pretrain.checkpointing import read_latest_iteration

    save = str(tmp_path / "ckpt")
    flags = ["--train-iters", "100", "--exit-duration-in-mins", "1e-4", "--save", save]
    proc = _torchrun(flags)
    out = _finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "done: 1 iterations (exit-duration-in-mins)" in out, out[-2000:]
    assert read_latest_iteration(save) == 1 and _complete(save, 1)


def test_nan_loss_exits_3_after_publishing_the_save_in_flight(tmp_path):
    from pentatron.pretrain.checkpointing import read_latest_iteration

    save = str(tmp_path / "ckpt")
    flags = ["--train-iters", "5", "--save", save, "--save-interval", "1", "--async-save"]
    proc = _torchrun(flags, entry=(FAULTY,), env={"NAN_AT_ITERATION": "3"})
    out = _finish(proc)
    assert proc.returncode == 1, out[-3000:]  # torchrun's status when a worker failed
    assert re.search(r"exitcode\s*:\s*3 ", out), out[-3000:]  # the workers' own
    assert "pentatron-pretrain: error: iteration 3: the loss" in out, out[-3000:]
    assert "NonFiniteLossError" not in out, out[-3000:]  # one line, no traceback
    assert read_latest_iteration(save) == 2 and _complete(save, 2)


def test_error_on_one_rank_exits_nonzero_promptly(tmp_path):
    started = time.monotonic()
    proc = _torchrun(["--train-iters", "5"], entry=(FAULTY,), env={"RAISE_AT_ITERATION": "2"})
    out = _finish(proc)
    assert proc.returncode == 1, out[-3000:]
    assert "RuntimeError: planted error on rank 1 at iteration 2" in out, out[-3000:]
    assert time.monotonic() - started < 120, out[-3000:]
