"""Run what CI runs: the noxfile's default sessions, then one line per session with its
result and time in seconds, and the total.

    .venv/bin/python tools/ci.py                      # CI's sessions (noxfile's defaults)
    .venv/bin/python tools/ci.py -s "tests(optim)"    # any nox arguments pass through

nox runs every session even after one fails; the exit status is non-zero when any failed,
and the last lines name each failed session. nox's own summary rounds times to minutes;
this one reads the seconds from nox's JSON report.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def summary(report: dict, wall: float) -> tuple[list[str], list[str]]:
    """The summary lines and the names of the sessions that did not succeed."""
    lines = [f"{'session':<32} {'result':<8} {'seconds':>8}"]
    failed = []
    for s in report.get("sessions", []):
        # the name a user types after `nox -s`: `tests(parallel-state)`, `lint`
        name = (s.get("signatures") or [s["name"]])[-1]
        lines.append(f"{name:<32} {s['result']:<8} {s['duration']:>8.0f}")
        if s["result"] not in ("success", "skipped"):
            failed.append(name)
    lines.append(f"{'total (wall)':<32} {'':<8} {wall:>8.0f}")
    return lines, failed


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "nox-report.json"
        cmd = [sys.executable, "-m", "nox", "--report", str(report_path), *argv]
        print("+", " ".join(cmd), flush=True)
        start = time.monotonic()
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        wall = time.monotonic() - start
        if not report_path.exists():  # nox failed before running any session (bad args)
            print(f"ci: nox exited {rc} before running a session", flush=True)
            return rc or 1
        report = json.loads(report_path.read_text())
    lines, failed = summary(report, wall)
    print("\n".join(["", "ci: sessions", *lines]), flush=True)
    if failed:
        print("ci: FAILED: " + ", ".join(failed), flush=True)
        return rc or 1
    if rc:
        print(f"ci: nox exited {rc}", flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
