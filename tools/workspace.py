"""Facts about the Pentatron workspace shared by tools/bootstrap.py and noxfile.py.

Standard library only: this runs before anything is installed.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

try:  # Python 3.11+
    import tomllib as _toml
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    _toml = None


def _load_toml(path: Path) -> dict:
    text = path.read_text()
    if _toml is not None:
        return _toml.loads(text)
    import tomli  # installed by bootstrap on 3.10

    return tomli.loads(text)


@dataclass(frozen=True)
class Member:
    """One workspace member (a wheel of its own)."""

    folder: str  # "parallel-state", as used in nox session names
    path: Path
    name: str  # distribution name, "pentatron-parallel-state"
    dependencies: tuple[str, ...]  # requirement strings from [project]

    def workspace_deps(self, members: dict[str, Member]) -> list[Member]:
        """The members this one requires, directly or transitively, in install order."""
        seen: dict[str, Member] = {}

        def visit(m: Member) -> None:
            for req in m.dependencies:
                dep = members.get(_req_name(req))
                if dep is not None and dep.name not in seen:
                    visit(dep)
                    seen[dep.name] = dep

        visit(self)
        return list(seen.values())


def _req_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9_.\-]+)", requirement)
    return re.sub(r"[-_.]+", "-", match.group(1)).lower() if match else ""


def members() -> dict[str, Member]:
    """Workspace members by distribution name, from the root [tool.uv.workspace] globs."""
    root = _load_toml(ROOT / "pyproject.toml")
    found: dict[str, Member] = {}
    for pattern in root["tool"]["uv"]["workspace"]["members"]:
        for path in sorted(ROOT.glob(pattern)):
            project_file = path / "pyproject.toml"
            if not project_file.is_file():
                continue
            project = _load_toml(project_file)["project"]
            name = _req_name(project["name"])
            found[name] = Member(path.name, path, name, tuple(project.get("dependencies", ())))
    return found


def install_order() -> list[Member]:
    """Every member, each after the members it depends on."""
    found = members()
    ordered: dict[str, Member] = {}
    for member in found.values():
        for dep in [*member.workspace_deps(found), member]:
            ordered.setdefault(dep.name, dep)
    return list(ordered.values())


def dev_requirements() -> list[str]:
    """The root `dev` dependency group."""
    return list(_load_toml(ROOT / "pyproject.toml")["dependency-groups"]["dev"])


def local_torch_requirement() -> str | None:
    """`torch==X` for a local CPU torch wheel in PIP_FIND_LINKS matching this Python, if any.

    Machines of our CI kind carry a CPU torch wheel on disk; an unpinned `torch` would pull a
    multi-GB CUDA build from the index instead. Elsewhere this returns None and the normal
    index build is used.
    """
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for folder in os.environ.get("PIP_FIND_LINKS", "").split():
        folder = folder.removeprefix("file://")
        if not os.path.isdir(folder):
            continue
        for wheel in sorted(Path(folder).glob(f"torch-*-{tag}-{tag}-*.whl"), reverse=True):
            version = wheel.name.split("-")[1].split("+")[0]
            return f"torch=={version}"
    return None


def torch_requirement() -> str:
    """The local CPU wheel's pin where there is one, else the range every member accepts."""
    return local_torch_requirement() or "torch>=2.4,<3"
