"""Install every workspace member (editable, with its test extra) and the dev tools into the
running interpreter's environment.

    python3 -m venv .venv && .venv/bin/python tools/bootstrap.py

Uses only pip. On machines that carry a local CPU torch wheel (PIP_FIND_LINKS) torch is pinned
to it, so no multi-GB CUDA build is downloaded; elsewhere pip resolves torch from the index.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> int:
    if sys.version_info < (3, 11):
        pip("install", "-q", "tomli")
    import workspace

    torch = workspace.torch_requirement()
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write(torch + "\n")
    # torch first and alone: a later resolver run then sees it satisfied and never upgrades it.
    pip("install", "-q", torch)
    pip("install", "-q", "-c", constraints.name, *workspace.dev_requirements())
    # One member per call, dependencies first: pip cannot resolve a member's requirement on an
    # unpublished sibling (pentatron-parallel-state) from an editable in the same call.
    for member in workspace.install_order():
        pip("install", "-q", "-c", constraints.name, "-e", f"{member.path}[test]")
    Path(constraints.name).unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
