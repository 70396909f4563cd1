"""Launch the training app many times and count the launches that did not end cleanly.

    .venv/bin/python tools/soak.py --launches 200 --out /tmp/soak

Each launch is `torchrun --standalone -m pentatron.pretrain` with the quickstart model
(examples/configs/quickstart-cpu.yaml without its layout, data and output keys), mock data
and a few iterations, cycling over layouts and checkpoint modes:

    layouts  tp2-dp2-sp-zero1 (4 processes), tp2-pp2-vpp2-dp2 (8, SP, ZeRO-1, overlapped
             grad reduce and param gather), ep2-moe (4: tp2 SP, 4 experts over ep2,
             all-to-all), cp2 (4: cp2 x dp2, ring attention)
    modes    plain (one launch), save-resume (a launch that saves every iteration and stops
             at --exit-interval, then one that resumes it), async-save-resume (the same with
             --async-save)

A launch fails unless torchrun exits 0, rank 0 says `done: N iterations` with the expected
N, no rank printed `terminate called` or the app's warning about threads left behind, the
latest checkpoint is the expected one, a resumed launch continues at the next iteration,
and no process of the launch is left once torchrun has exited. The report gives launches
and failures per case and the first error line of each failure; the logs of failed launches
stay in --out. Exit status 1 if any launch failed. Not part of CI: 200 launches take about
40 minutes on 2 cores (docs/launch.md has the last result).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "configs" / "quickstart-cpu.yaml"
# Keys of the quickstart config a soak launch sets itself (layout, length, data, output).
DROPPED = (
    "tensor-model-parallel-size",
    "pipeline-model-parallel-size",
    "num-layers-per-virtual-pipeline-stage",
    "sequence-parallel",
    "use-distributed-optimizer",
    "train-iters",
    "lr-warmup-iters",
    "eval-interval",
    "eval-iters",
    "save",
    "load",
    "save-interval",
    "tensorboard-dir",
)
TP2_SP_ZERO1 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
TP2_SP_ZERO1 += ["--use-distributed-optimizer"]
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "tp2-dp2-sp-zero1": (4, TP2_SP_ZERO1),
    "tp2-pp2-vpp2-dp2": (
        8,
        [
            *TP2_SP_ZERO1,
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
        ],
    ),
    "ep2-moe": (
        4,
        [
            *TP2_SP_ZERO1,
            "--num-experts",
            "4",
            "--moe-router-topk",
            "2",
            "--moe-ffn-hidden-size",
            "128",
            "--expert-model-parallel-size",
            "2",
            "--moe-token-dispatcher-type",
            "alltoall",
        ],
    ),
    "cp2": (
        4,
        ["--context-parallel-size", "2", "--cp-comm-type", "p2p", "--use-distributed-optimizer"],
    ),
}
MODES = ("plain", "save-resume", "async-save-resume")
# The first of these a failed launch printed is its "first error" (most telling first).
ERROR_PATTERNS = [
    r"terminate called.*",
    r"pentatron-pretrain: (error|warning):.*",
    r"^\S*(Error|Exception)\b.*",
    r"Signal \d+ \(\w+\) received.*",
    r"exitcode\s*:\s*-?\d+.*",
]


@dataclass
class Launch:
    case: str  # layout/mode
    step: str  # "run", "save" or "resume"
    world: int
    argv: list[str]
    iterations: int  # what `done:` must say
    first_iteration: int  # the first iteration line expected
    latest: int | None = None  # the latest checkpoint expected after it


@dataclass
class Tally:
    launches: int = 0
    failures: list[str] = field(default_factory=list)


def soak_config(out: Path) -> Path:
    """The quickstart config without the keys a soak launch sets itself."""
    lines = QUICKSTART.read_text().splitlines()
    kept = [ln for ln in lines if ln.split(":", 1)[0].strip() not in DROPPED]
    path = out / "soak.yaml"
    path.write_text("\n".join(kept) + "\n")
    return path


def case_launches(layout: str, mode: str, config: Path, work: Path, iters: int) -> list[Launch]:
    """The launches of one case: one for `plain`, a saving and a resuming one otherwise."""
    world, flags = LAYOUTS[layout]
    common = ["--config", str(config), *flags, "--mock-data", "--no-progress"]
    common += ["--lr-warmup-iters", "1", "--eval-iters", "0", "--log-interval", "1"]
    case = f"{layout}/{mode}"
    if mode == "plain":
        return [Launch(case, "run", world, [*common, "--train-iters", str(iters)], iters, 1)]
    ckpt = str(work / "ckpt")
    save = ["--train-iters", str(2 * iters), "--save", ckpt, "--save-interval", "1"]
    if mode == "async-save-resume":
        save.append("--async-save")
    first = [*common, *save, "--exit-interval", str(iters)]
    second = [*common, *save, "--load", ckpt]
    return [
        Launch(case, "save", world, first, iters, 1, latest=iters),
        Launch(case, "resume", world, second, 2 * iters, iters + 1, latest=2 * iters),
    ]


def run_launch(launch: Launch, cwd: Path, timeout: float) -> tuple[bool, str, str]:
    """(ok, first error, output) of one launch, in its own session so that every process
    it leaves behind can be found."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(launch.world), "-m", "pentatron.pretrain", *launch.argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        out, _ = proc.communicate()
        return False, f"timeout: still running after {timeout:.0f} s", out
    stray = _session_pids(proc.pid)
    if stray:
        _kill_session(proc.pid)
        return False, f"processes left after torchrun exited: {stray}", out
    return (*check(launch, proc.returncode, out, cwd), out)


def check(launch: Launch, returncode: int, out: str, cwd: Path) -> tuple[bool, str]:
    if "terminate called" in out or "pentatron-pretrain: warning" in out:
        return False, first_error(out)
    if returncode != 0:
        return False, f"exit status {returncode}: {first_error(out)}"
    done = re.search(r"^done: (\d+) iterations", out, re.M)
    if done is None or int(done.group(1)) != launch.iterations:
        return False, f"expected 'done: {launch.iterations} iterations', got {done and done[0]!r}"
    its = [int(m) for m in re.findall(r"iteration\s+(\d+)/", out)]
    if not its or its[0] != launch.first_iteration:
        return False, f"first iteration {its[:1]}, expected {launch.first_iteration}"
    if launch.latest is not None:
        latest_file = cwd / "ckpt" / "latest_checkpointed_iteration.txt"
        latest = int(latest_file.read_text()) if latest_file.exists() else None
        if latest != launch.latest:
            return False, f"latest checkpoint {latest}, expected {launch.latest}"
    return True, ""


def first_error(out: str) -> str:
    lines = out.splitlines()
    for pattern in ERROR_PATTERNS:
        for line in lines:
            m = re.search(pattern, line.strip())
            if m:
                return m.group(0)[:300]
    return (lines[-1] if lines else "(no output)")[:300]


def _session_pids(sid: int) -> list[int]:
    """Processes whose session is `sid` (Linux /proc; [] elsewhere)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session
            pids.append(int(entry.name))
    return pids


def _kill_session(sid: int) -> None:
    for pid in _session_pids(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=200, help="total launches (default 200)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated")
    p.add_argument("--iters", type=int, default=2, help="iterations per launch (default 2)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    p.add_argument("--out", default="soak-out", help="work folder; failed launches' logs")
    args = p.parse_args(argv)
    layouts, modes = args.layouts.split(","), args.modes.split(",")
    for name in layouts:
        if name not in LAYOUTS:
            p.error(f"--layouts: unknown {name!r}; choose from {', '.join(LAYOUTS)}")
    for name in modes:
        if name not in MODES:
            p.error(f"--modes: unknown {name!r}; choose from {', '.join(MODES)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = soak_config(out)
    tallies: dict[str, Tally] = {}
    started, n = time.monotonic(), 0
    # Modes in the outer cycle, layouts in the inner, so consecutive launches differ.
    for k, (mode, layout) in enumerate(itertools.cycle(itertools.product(modes, layouts))):
        if n >= args.launches:
            break
        work = out / f"case{k:04d}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        case_ok = True
        for launch in case_launches(layout, mode, config, work, args.iters):
            if n >= args.launches:
                break
            n += 1
            tally = tallies.setdefault(launch.case, Tally())
            tally.launches += 1
            t0 = time.monotonic()
            ok, error, log = run_launch(launch, work, args.timeout)
            status = "ok" if ok else "FAILED"
            print(
                f"[{n}/{args.launches}] {launch.case} {launch.step}: {status} "
                f"({time.monotonic() - t0:.0f} s){'' if ok else ': ' + error}",
                flush=True,
            )
            if not ok:
                tally.failures.append(f"launch {n} ({launch.step}): {error}")
                (out / f"failed-{n:04d}.log").write_text(" ".join(launch.argv) + "\n" + log)
                case_ok = False
                break  # a failed save: its resume would fail for the same reason
        if case_ok:
            shutil.rmtree(work, ignore_errors=True)
    total = sum(t.launches for t in tallies.values())
    failed = sum(len(t.failures) for t in tallies.values())
    minutes = (time.monotonic() - started) / 60
    print(f"\n{total} launches, {failed} failures, {minutes:.1f} min")
    for case, t in sorted(tallies.items()):
        print(f"  {case:36s} {t.launches:4d} launches {len(t.failures):3d} failures")
        for f in t.failures:
            print(f"      {f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
