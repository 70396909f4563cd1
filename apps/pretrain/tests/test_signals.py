"""Acceptance (faults): SIGTERM to the workers mid-run (what Slurm and torchrun send on
preemption) makes every rank finish its iteration, save a checkpoint and exit 0; the next
run resumes from that iteration. Real processes: torchrun with 2 workers."""

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


def _torchrun(extra: list[str], **kwargs) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "pentatron.pretrain",
        *ARGS,
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
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
