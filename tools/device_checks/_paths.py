"""The repository's sources on `sys.path` / `PYTHONPATH`, for machines where the Pentatron
packages are not installed (the GPU machine gets a copy of the working tree, nothing else).

`pentatron` is a PEP 420 namespace package (no `pentatron/__init__.py`): every
`packages/*/src` and `apps/*/src` folder on the path adds its `pentatron.<name>`
subpackage. `import _paths` at the top of a device-check script is enough (the script's
own folder is `sys.path[0]`); `source_dirs()` gives the same folders to subprocesses.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


def source_dirs() -> list[str]:
    """`packages/*/src` and `apps/*/src` of this checkout, in a stable order."""
    return [str(p) for p in sorted([*REPO.glob("packages/*/src"), *REPO.glob("apps/*/src")])]


def install() -> None:
    """Put the source folders first on this process's `sys.path` (idempotent)."""
    for path in reversed(source_dirs()):
        if path not in sys.path:
            sys.path.insert(0, path)


def pythonpath(existing: str | None = None) -> str:
    """A `PYTHONPATH` value with the source folders before `existing`."""
    parts = source_dirs() + ([existing] if existing else [])
    return os.pathsep.join(parts)


def load_benchmark(name: str) -> ModuleType:
    """`benchmarks/<name>.py` as a module (`benchmarks/` is not a package)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


install()
