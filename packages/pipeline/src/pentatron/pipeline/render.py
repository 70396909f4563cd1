"""Gantt chart of a timeline as a PNG: matplotlib when installed (extra `plot`), else a
small built-in rasteriser (zlib + struct), so the CLI works with torch alone.

Rows are ranks (rank 0 on top); forward passes are blue, backward passes green, a
zero-bubble schedule's weight-gradient passes orange (darker shades for higher chunks),
idle time is white.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

from .timeline import COMPUTE_KINDS, Event

_FORWARD = [(66, 133, 244), (25, 80, 170), (10, 45, 110), (5, 25, 70)]
_BACKWARD = [(52, 168, 83), (20, 110, 50), (10, 70, 30), (5, 40, 15)]
_WEIGHT = [(251, 140, 0), (200, 100, 0), (150, 70, 0), (100, 45, 0)]
_SHADES = {"forward": _FORWARD, "backward": _BACKWARD, "weight": _WEIGHT}


def _color(e: Event) -> tuple[int, int, int]:
    shades = _SHADES[e.kind]
    return shades[min(e.chunk or 0, len(shades) - 1)]


def render_png(
    events: Sequence[Event], path: str | Path, title: str = "", use_matplotlib: bool | None = None
) -> Path:
    """Write the Gantt chart of `events` to `path`; returns the path."""
    path = Path(path)
    compute = [e for e in events if e.kind in COMPUTE_KINDS]
    if use_matplotlib is None:
        try:
            import matplotlib  # noqa: F401

            use_matplotlib = True
        except ImportError:
            use_matplotlib = False
    if use_matplotlib:
        _render_matplotlib(compute, path, title)
    else:
        _render_builtin(compute, path)
    return path


def _render_matplotlib(events: Sequence[Event], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({e.rank for e in events})
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1))
    for e in events:
        color = tuple(c / 255 for c in _color(e))
        ax.barh(e.rank, e.duration, left=e.start, color=color, edgecolor="white", height=0.8)
        ax.text(
            e.start + e.duration / 2,
            e.rank,
            str(e.microbatch),
            ha="center",
            va="center",
            color="white",
            fontsize=7,
        )
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _render_builtin(
    events: Sequence[Event], path: Path, px_per_unit: int = 12, row: int = 24, gap: int = 4
) -> None:
    ranks = sorted({e.rank for e in events})
    end = max(e.end for e in events)
    width = max(1, round(end * px_per_unit))
    height = len(ranks) * (row + gap) + gap
    pixels = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]
    for e in events:
        top = gap + ranks.index(e.rank) * (row + gap)
        x0 = round(e.start * px_per_unit)
        x1 = max(x0 + 1, round(e.end * px_per_unit) - 1)  # 1 px white seam between ops
        rgb = bytes(_color(e))
        for y in range(top, top + row):
            pixels[y][3 * x0 : 3 * x1] = rgb * (x1 - x0)
    raw = b"".join(b"\x00" + bytes(line) for line in pixels)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + tag
            + data
            + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )
