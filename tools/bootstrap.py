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

    torch_pin = workspace.local_torch_requirement()
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write((torch_pin or "") + "\n")
    # torch first and alone: a later resolver run then sees it satisfied and never upgrades it.
    pip("install", "-q", torch_pin or "torch>=2.4,<3")
    # Members one at a time in dependency order: pip cannot resolve a member's requirement on
    # an unpublished sibling (pentatron-parallel-state) from an editable in the same call.
    members = workspace.members()
    ordered: dict[str, workspace.Member] = {}
    for member in members.values():
        for dep in [*member.workspace_deps(members), member]:
            ordered.setdefault(dep.name, dep)
    pip("install", "-q", "-c", constraints.name, *workspace.dev_requirements())
    for member in ordered.values():
        pip("install", "-q", "-c", constraints.name, "-e", f"{member.path}[test]")
    Path(constraints.name).unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
