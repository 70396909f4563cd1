"""Megatron's checkpoint folder layout: `iter_XXXXXXX` dirs and the latest-iteration file.

    save_dir/
      iter_0000100/                     one checkpoint (DCP files + common.json)
      iter_0000200.tmp/                 a save in progress (renamed when complete)
      latest_checkpointed_iteration.txt "200", rewritten last and atomically

A save that dies before the rename leaves a `.tmp` folder that nothing reads; the latest
file always names a complete folder.
"""

from __future__ import annotations

import os
import re
import shutil

TRACKER = "latest_checkpointed_iteration.txt"
_ITER = re.compile(r"^iter_(\d{7,})$")


def iter_dir(root: str, iteration: int) -> str:
    """`root/iter_0000100` for iteration 100."""
    return os.path.join(root, f"iter_{iteration:07d}")


def temp_dir(root: str, iteration: int) -> str:
    """Where a save of `iteration` is written before it is renamed to `iter_dir`."""
    return iter_dir(root, iteration) + ".tmp"


def read_latest_iteration(root: str) -> int | None:
    """The iteration the latest file names; None when `root` holds no checkpoint."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(
            f"{path} holds {text!r}, not an iteration number; fix: write the iteration of a "
            "complete iter_XXXXXXX folder into it, or delete it"
        )
    return int(text)


def write_latest_iteration(root: str, iteration: int) -> None:
    """Atomic: a reader sees the old number or the new one, never a partial file."""
    path = os.path.join(root, TRACKER)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def list_iterations(root: str) -> list[int]:
    """Iterations of the complete `iter_XXXXXXX` folders in `root`, ascending."""
    if not os.path.isdir(root):
        return []
    found = (_ITER.match(name) for name in os.listdir(root))
    return sorted(int(m.group(1)) for m in found if m)


def prune(root: str, keep_last: int) -> list[int]:
    """Delete all but the newest `keep_last` checkpoints (never the latest); returns them."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: must be >= 1; fix: pass None to keep all")
    latest = read_latest_iteration(root)
    old = [i for i in list_iterations(root)[:-keep_last] if i != latest]
    for i in old:
        shutil.rmtree(iter_dir(root, i), ignore_errors=True)
    return old


def detect_format(path: str) -> str:
    """The format of the checkpoint folder `path` (Megatron's --auto-detect-ckpt-format):
    "torch_dist" for ours (DCP files + common.json), "megatron-<backend>" for a Megatron-LM
    distributed checkpoint (metadata.json names its backend), "torch" for Megatron-LM's
    legacy per-rank files (mp_rank_*/model_optim_rng.pt), "unknown" otherwise."""
    import json

    if os.path.isfile(os.path.join(path, "common.json")):
        return "torch_dist"
    meta = os.path.join(path, "metadata.json")
    if os.path.isfile(meta):
        with open(meta) as f:
            backend = json.load(f).get("sharded_backend", "unknown")
        return f"megatron-{backend}"
    if any(name.startswith("mp_rank_") for name in os.listdir(path)):
        return "torch"
    return "unknown"
