"""Acceptance (faults): SIGTERM to the workers mid-run (what Slurm and torchrun send on
preemption) makes every rank finish its iteration, save a checkpoint and exit 0; the next
run resumes from that iteration. A worker SIGKILLed in the middle of a save leaves the
previous checkpoint as latest, and the next run loads it. Real processes: torchrun with 2
workers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ARGS = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--mock-data",
    "--vocab-size",
    "255",
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
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, **kwargs
    )


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
    proc = _torchrun(["--train-iters", "100000", "--save", save])
    lines = _wait_for_line(proc, r"iteration\s+3/")
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=240)
    log = "".join(lines) + out
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
    out, _ = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, out[-3000:]
    its = [int(m) for m in re.findall(r"iteration\s+(\d+)/", out)]
    assert its == [latest + 1, latest + 2], out[-2000:]
    assert read_latest_iteration(save) == latest + 2


def _checkpoint_entries(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(("iter_", "latest")))


def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path):
    from pentatron.pretrain.checkpointing import read_latest_iteration

    save = str(tmp_path / "ckpt")
    killer = str(Path(__file__).with_name("_kill_during_save.py"))
    flags = ["--train-iters", "4", "--save-interval", "2", "--save", save]
    proc = _torchrun(flags, entry=(killer,), env={"KILL_SAVE_DIR": "iter_0000004.tmp"})
    out, _ = proc.communicate(timeout=240)
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
    out, _ = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, out[-3000:]
    its = [int(m) for m in re.findall(r"iteration\s+(\d+)/", out)]
    assert its == [3, 4], out[-2000:]
    assert read_latest_iteration(save) == 4
    assert _checkpoint_entries(save) == [
        "iter_0000002",
        "iter_0000004",
        "latest_checkpointed_iteration.txt",
    ]
