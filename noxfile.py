"""Nox sessions for the Pentatron workspace.

    nox -l                          # list sessions
    nox -s "tests(parallel-state)"  # one member's tests, all of them, with its workspace deps
    nox -s lint typecheck
    nox -s standalone               # every member's wheel installed alone in a fresh venv
    nox -s "checkout(pretrain)"     # the tests that read the source checkout, editable
    nox -s "examples(tp-layers)"    # a member's examples/ run under torchrun, wheel alone
    nox                             # what CI runs (below), then each session's result and time

CI runs each test once, in the strictest environment it can run in: against the member's
wheel installed alone (`standalone`), except the tests marked `checkout` (they read the
README, examples/, benchmarks/ or tools/, which a wheel's test copy does not have), which
`checkout` runs with the member installed editable. `tests` runs a member's whole suite
editable, for development; CI does not run it, since `standalone` + `checkout` are the same
tests in a stricter environment, and running both would double CI's time.

Members are discovered from the root [tool.uv.workspace] globs, so a new package gets its
sessions without editing this file. torch is pinned to the local CPU wheel where the machine
has one (see tools/workspace.py). With uv installed (the dev group has it) every session's
venv is made by uv and shares uv's cache, so the torch wheel is unpacked once per machine.
The members' wheels are built once per nox run and shared by the standalone and examples
sessions.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))
import workspace

# Sessions' processes cache bytecode even where the caller's environment says not to
# (PYTHONDONTWRITEBYTECODE=1 on the CI machines). uv installs without .pyc files, so every
# process of a session compiled the sources of everything it imported again: `import
# torch` + DCP took 6 s of CPU instead of 2.4 s, in the pytest process, the harness's
# forkserver, each torchrun launch and each of its workers (pretrain's signal tests: 118 s
# -> 77 s). Compiled once, on first import; __pycache__ is git-ignored.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

if os.environ.get("PIP_FIND_LINKS") and not os.environ.get("UV_FIND_LINKS"):
    # uv ignores pip's settings; without this it would not see the local torch wheel.
    os.environ["UV_FIND_LINKS"] = os.environ["PIP_FIND_LINKS"]

nox.options.default_venv_backend = "uv|virtualenv"
# `nox` alone runs what CI runs (the README's test command names them).
nox.options.sessions = ["lint", "typecheck", "checkout", "standalone", "examples"]

MEMBERS = workspace.members()
FOLDERS = [m.folder for m in MEMBERS.values()]
BY_FOLDER = {m.folder: m for m in MEMBERS.values()}
WITH_EXAMPLES = [m.folder for m in MEMBERS.values() if (m.path / "examples").is_dir()]
PYTEST_ARGS = ["-q", "-p", "no:cacheprovider", "--import-mode=importlib"]
# The marker of tests that read the source checkout (registered by parallel-state's plugin).
CHECKOUT_MARK = "pytest.mark.checkout"


def _has_checkout_tests(member: workspace.Member) -> bool:
    return any(CHECKOUT_MARK in f.read_text() for f in (member.path / "tests").glob("test_*.py"))


WITH_CHECKOUT_TESTS = [m.folder for m in MEMBERS.values() if _has_checkout_tests(m)]


def install_torch(session: nox.Session) -> None:
    session.install(workspace.torch_requirement())


_BUILT: set[str] = set()  # folders of the members whose wheels this nox run has built


@functools.cache
def _wheel_dir() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="pentatron-wheels-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def member_wheels(session: nox.Session, members: list[workspace.Member]) -> Path:
    """Build these members' wheels (each once per nox run) and return the folder holding them.

    Built with the dev group's uv, outside any session venv, into one temporary folder per
    run: a later run rebuilds from the current sources.
    """
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv is None:
        session.error("uv builds the wheels: install it (`pip install uv`; the dev group has it)")
    for m in members:
        if m.folder not in _BUILT:
            session.run(
                uv,
                "build",
                "--wheel",
                "--out-dir",
                str(_wheel_dir()),
                str(m.path),
                silent=True,
                external=True,
            )
            _BUILT.add(m.folder)
    return _wheel_dir()


def _install_editable(session: nox.Session, member: str) -> workspace.Member:
    """torch, then the member (with its test extra) and its workspace deps, all editable."""
    target = BY_FOLDER[member]
    install_torch(session)
    deps = [arg for dep in target.workspace_deps(MEMBERS) for arg in ("-e", str(dep.path))]
    session.install(*deps, "-e", f"{target.path}[test]")
    return target


@nox.session
@nox.parametrize("member", FOLDERS, ids=FOLDERS)
def tests(session: nox.Session, member: str) -> None:
    """One member's whole suite, editable with its workspace deps (development; not in CI).

    CI runs the same tests as `standalone(<member>)` + `checkout(<member>)`.
    """
    target = _install_editable(session, member)
    session.run("pytest", str(target.path / "tests"), *PYTEST_ARGS, *session.posargs)


@nox.session
@nox.parametrize("member", WITH_CHECKOUT_TESTS, ids=WITH_CHECKOUT_TESTS)
def checkout(session: nox.Session, member: str) -> None:
    """The member's tests that read the source checkout (marked `checkout`), editable.

    They read the README, examples/, benchmarks/ or tools/; `standalone` runs the rest.
    The member and its workspace dependencies are installed editable.
    """
    target = _install_editable(session, member)
    session.run(
        "pytest", str(target.path / "tests"), *PYTEST_ARGS, "-m", "checkout", *session.posargs
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over every member's sources, with all members installed."""
    install_torch(session)
    session.install("mypy>=1.10", *(f"-e{m.path}" for m in MEMBERS.values()))
    sources = [str(m.path / "src") for m in MEMBERS.values()]
    session.run("mypy", *sources)


@nox.session
@nox.parametrize("member", FOLDERS, ids=FOLDERS)
def standalone(session: nox.Session, member: str) -> None:
    """The member's wheel alone (only its declared deps): its tests, but those marked checkout.

    `checkout(<member>)` runs the tests marked `checkout`.

    The tests (and the member's examples/, which some tests run) are copied out of the tree
    and run from a temporary folder, so nothing can be imported from the source checkout by
    accident.
    """
    target = BY_FOLDER[member]
    # Every member's wheel: a test extra may name a sibling (optim's tests build tp-layers).
    dist = member_wheels(session, list(MEMBERS.values()))
    install_torch(session)
    session.install("--find-links", str(dist), f"{target.name}[test]")
    with tempfile.TemporaryDirectory() as tmp:
        tests_copy = Path(tmp) / "tests"
        shutil.copytree(target.path / "tests", tests_copy)
        if (target.path / "examples").is_dir():  # some tests run the package's examples
            shutil.copytree(target.path / "examples", Path(tmp) / "examples")
        session.chdir(tmp)
        module = "pentatron." + target.folder.replace("-", "_")
        session.run(
            "python", "-c", f"import {module} as m; print(m.__name__, m.__version__, m.__file__)"
        )
        session.run(
            "pytest",
            "tests",
            *PYTEST_ARGS,
            "-c",
            os.devnull,
            "--rootdir",
            tmp,
            "-m",
            "not checkout",
            *session.posargs,
        )


def _nproc(example: Path) -> int:
    """The `--nproc-per-node N` of the first torchrun line in the example's docstring, else 2."""
    match = re.search(r"torchrun[^\n]*--nproc[-_]per[-_]node[= ](\d+)", example.read_text())
    return int(match.group(1)) if match else 2


@nox.session
@nox.parametrize("member", WITH_EXAMPLES, ids=WITH_EXAMPLES)
def examples(session: nox.Session, member: str) -> None:
    """Install this member's wheel alone (only its declared deps) and run each example.

    Only the member and the workspace members it depends on are built. The examples are
    copied to a temporary folder and launched from there with `torchrun --standalone`, with
    as many processes as the example's own docstring launches it with; an example checks its
    own results and exits non-zero when they are wrong.
    """
    target = BY_FOLDER[member]
    dist = member_wheels(session, [*target.workspace_deps(MEMBERS), target])
    install_torch(session)
    session.install("--find-links", str(dist), target.name)
    with tempfile.TemporaryDirectory() as tmp:
        examples_copy = Path(tmp) / "examples"
        shutil.copytree(target.path / "examples", examples_copy)
        session.chdir(tmp)
        scripts = sorted(examples_copy.glob("*.py"))
        if not scripts:
            session.error(f"{target.path / 'examples'} holds no *.py example")
        for script in scripts:
            nproc = _nproc(script)
            session.log(f"{script.name}: torchrun --standalone --nproc-per-node {nproc}")
            session.run(
                "torchrun",
                "--standalone",
                "--nproc-per-node",
                str(nproc),
                str(script),
                env={"OMP_NUM_THREADS": "1"},
            )
