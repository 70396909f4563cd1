"""The training app's command lines for the device checks, and what its metrics JSONL says.

Shapes (`AppShape`): ISSUE is issue #20's ~0.89B Llama-shaped GPT (16 layers, hidden 2048,
16 heads over 8 query groups, SwiGLU ffn 5632, RMSNorm, RoPE, untied embeddings, no linear
biases, vocabulary 32000, micro-batch 4 x seq 2048, global batch 16: 4 micro-batches per
step), the same model as `benchmarks/gpu_mfu.py`'s ISSUE_SHAPE. With --mock-data the app's
NullTokenizer adds the end-of-document id to `--vocab-size`, so `--vocab-size 31999` gives
the model exactly 32000 rows (a multiple of 128: no padding), as the plain loop and
transformers have. SMALL is a ~20M model for the checks that need a GPU but not the
issue's size; TINY the CPU smoke shape.

Only the standard library here: run_all.py imports it without torch.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class AppShape:
    layers: int
    hidden: int
    heads: int
    groups: int
    ffn: int
    seq: int
    micro_batch: int
    global_batch: int
    vocab: int  # the model's rows; the app gets vocab - 1 (+ the eod id)


ISSUE = AppShape(16, 2048, 16, 8, 5632, 2048, 4, 16, 32000)
SMALL = AppShape(4, 512, 8, 4, 1408, 512, 4, 16, 8192)
TINY = AppShape(2, 64, 4, 2, 176, 64, 2, 8, 512)


def model_flags(s: AppShape) -> list[str]:
    return [
        "--num-layers", str(s.layers), "--hidden-size", str(s.hidden),
        "--num-attention-heads", str(s.heads), "--group-query-attention",
        "--num-query-groups", str(s.groups), "--swiglu", "--ffn-hidden-size", str(s.ffn),
        "--normalization", "RMSNorm", "--position-embedding-type", "rope",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--seq-length", str(s.seq), "--max-position-embeddings", str(s.seq),
        "--hidden-dropout", "0", "--attention-dropout", "0", "--transformer-impl", "local",
    ]  # fmt: skip


def run_flags(
    s: AppShape, device: str, iters: int, *, lr: float = 3e-4, dist_opt: bool = True
) -> list[str]:
    """bf16, mock data, one process, the distributed optimizer (unless `dist_opt=False`),
    log every iteration, no evaluation, no checkpoint."""
    return [
        *model_flags(s),
        "--micro-batch-size", str(s.micro_batch), "--global-batch-size", str(s.global_batch),
        "--mock-data", "--vocab-size", str(s.vocab - 1), "--bf16",
        *(["--use-distributed-optimizer"] if dist_opt else []),
        "--device", device, "--train-iters", str(iters), "--lr", str(lr),
        "--lr-warmup-iters", "2", "--seed", "1234",
        "--log-interval", "1", "--eval-iters", "0", "--no-progress",
    ]  # fmt: skip


def read_train_records(path: str | Path) -> list[dict]:
    """The `split == "train"` records of a metrics JSONL, in order ([] if it is missing)."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a half-written last line of a killed run
        if rec.get("split") == "train":
            out.append(rec)
    return out


def _median(values: list) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(records: list[dict], warmup: int, peak_tflops: float | None) -> dict:
    """Medians over the iterations after `warmup` (records logged every iteration):
    tokens/s, ms per iteration, model TFLOP/s per device and MFU; the loss trend (first
    iteration vs the mean of the last two) and the peak memory."""
    timed = [r for r in records if r.get("iteration", 0) > warmup]
    losses = [r.get("lm_loss") for r in records]
    finite = [x for x in losses if x is not None and math.isfinite(x)]
    tflops = _median([r.get("tflops_per_device") for r in timed])
    it_s = _median([r.get("iteration_time_s") for r in timed])
    tail = finite[-2:]
    first = finite[0] if finite else None
    last = sum(tail) / len(tail) if tail else None
    mem = [r.get("memory_bytes") for r in records if r.get("memory_bytes")]
    return {
        "iterations": len(records),
        "timed_iterations": len(timed),
        "warmup": warmup,
        "tokens_per_s": _median([r.get("tokens_per_s") for r in timed]),
        "iteration_ms": None if it_s is None else it_s * 1e3,
        "tflops": tflops,
        "mfu": None if tflops is None or not peak_tflops else tflops / peak_tflops,
        "loss_first": first,
        "loss_last": last,
        "loss_down": first is not None and last is not None and last < first,
        "nan_iterations": sum(int(r.get("nan_iterations") or 0) for r in records),
        "mem_gib": max(mem) / 2**30 if mem else None,
        "losses": losses,
    }


def describe(m: dict) -> str:
    """One short line: tokens/s, ms/it, TFLOP/s, MFU, the loss trend, memory."""
    parts = []
    if m.get("tokens_per_s"):
        parts.append(f"{m['tokens_per_s']:,.0f} tok/s")
    if m.get("iteration_ms"):
        parts.append(f"{m['iteration_ms']:.0f} ms/it")
    if m.get("tflops") is not None:
        parts.append(f"{num(m['tflops'])} TFLOP/s")
    if m.get("mfu") is not None:
        parts.append(f"MFU {m['mfu']:.1%}")
    parts.append(loss_trend(m))
    if m.get("mem_gib"):
        parts.append(f"{m['mem_gib']:.1f} GiB")
    return ", ".join(parts)


def num(x: float) -> str:
    """1 decimal from 1 up, 3 significant digits below (tiny CPU figures stay readable)."""
    return f"{x:.1f}" if abs(x) >= 1 else f"{x:.3g}"


def loss_trend(m: dict) -> str:
    if m.get("loss_first") is None:
        return "no loss logged"
    word = "down" if m["loss_down"] else "NOT down"
    return f"loss {m['loss_first']:.2f}->{m['loss_last']:.2f} {word}"


def derive_config(src: Path, drop: tuple[str, ...], dst: Path) -> Path:
    """A copy of the app YAML `src` without the top-level keys in `drop` (flags that the
    command line cannot unset, e.g. `sequence-parallel: true` at tp 1, or a checkpoint
    folder); every other key is kept and may be overridden by a flag as usual."""
    kept = []
    for line in src.read_text().splitlines():
        key = line.split(":", 1)[0].strip() if ":" in line and not line[:1].isspace() else None
        if key in drop:
            continue
        kept.append(line)
    dst.write_text("\n".join(kept) + "\n")
    return dst
