"""`pentatron-preprocess-data`: jsonl -> Megatron indexed dataset (.bin/.idx), as Megatron's
`tools/preprocess_data.py`.

    pentatron-preprocess-data --input corpus.jsonl --json-keys text \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model my-tokenizer/ \\
        --output-prefix out/corpus --append-eod --workers 4

writes `out/corpus_text_document.bin` and `.idx` (one pair per json key), the name Megatron
uses, to pass as `--data-path out/corpus_text_document`. Each jsonl line is one document and
one sequence; `--append-eod` adds the tokenizer's end-of-document id after each. Lines are
tokenized by `--workers` processes in input order, so the output is the same for any worker
count. `--partitions N` splits the input into N contiguous parts, builds each, then merges.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..tokenizer.arguments import add_tokenizer_file_args, tokenizer_from_args
from ..tokenizer.factory import TOKENIZER_TYPES
from .indexed_dataset import DType, IndexedDatasetBuilder, data_file_path, index_file_path

_WORKER: dict = {}


def _init_worker(args) -> None:
    _WORKER["tokenizer"] = tokenizer_from_args(args)
    _WORKER["keys"] = tuple(args.json_keys)
    _WORKER["append_eod"] = args.append_eod


def _encode(item: tuple[int, str]) -> tuple[dict[str, list[int]] | str, int]:
    """(line number, line) -> ({key: ids} or an error message, bytes read)."""
    lineno, line = item
    tok = _WORKER["tokenizer"]
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return f"line {lineno}: not valid JSON ({exc.msg})", len(line)
    if not isinstance(record, dict):
        return f"line {lineno}: expected a JSON object", len(line)
    out = {}
    for key in _WORKER["keys"]:
        if key not in record:
            return f"line {lineno}: --json-keys key {key!r} missing", len(line)
        ids = tok.tokenize(str(record[key]))
        if ids and _WORKER["append_eod"]:
            ids.append(tok.eod)
        out[key] = ids
    return out, len(line)


def _lines(path: str, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if lineno <= start:
                continue
            if stop is not None and lineno > stop:
                break
            if line.strip():
                yield lineno, line


def _count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def _output_prefix(prefix: str, key: str) -> str:
    return f"{prefix}_{key}_document"


def _process(args, lines, prefixes: dict[str, str], dtype, pool, log) -> int:
    builders = {
        key: IndexedDatasetBuilder(data_file_path(p), dtype=dtype) for key, p in prefixes.items()
    }
    try:
        encoded = (
            pool.imap(_encode, lines, chunksize=32) if pool is not None else map(_encode, lines)
        )
        count, nbytes, start = 0, 0, time.perf_counter()
        for result, size in encoded:
            if isinstance(result, str):
                raise ValueError(f"--input {args.input}: {result}")
            for key, ids in result.items():
                if ids:
                    builders[key].add_item(np.asarray(ids, dtype=dtype))
                builders[key].end_document()
            count += 1
            nbytes += size
            if log and count % args.log_interval == 0:
                dt = max(time.perf_counter() - start, 1e-9)
                print(
                    f"processed {count} documents ({count / dt:.0f} docs/s, {nbytes / dt / 1e6:.2f} MB/s)",
                    file=sys.stderr,
                    flush=True,
                )
        for key, b in builders.items():
            b.finalize(index_file_path(prefixes[key]))
        return count
    except BaseException:
        for b in builders.values():
            b.abort()
        raise


def preprocess(args) -> dict[str, str]:
    """Run the conversion described by parsed `args`; return {json key: output prefix}."""
    if not os.path.isfile(args.input):
        raise ValueError(f"--input {args.input}: no such file")
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.partitions < 1:
        raise ValueError(f"--partitions must be >= 1, got {args.partitions}")
    tokenizer = tokenizer_from_args(args)  # fail fast, in this process, on a bad tokenizer
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    outputs = {key: _output_prefix(args.output_prefix, key) for key in args.json_keys}
    start = time.perf_counter()
    ctx = multiprocessing.get_context("spawn") if args.workers > 1 else None
    pool = ctx.Pool(args.workers, initializer=_init_worker, initargs=(args,)) if ctx else None
    if pool is None:
        _init_worker(args)
    try:
        if args.partitions == 1:
            count = _process(args, _lines(args.input), outputs, dtype, pool, not args.quiet)
        else:
            total = _count_lines(args.input)
            bounds = [round(i * total / args.partitions) for i in range(args.partitions + 1)]
            count, parts = 0, []
            for i in range(args.partitions):
                part = {key: f"{p}.part{i}" for key, p in outputs.items()}
                lines = _lines(args.input, bounds[i], bounds[i + 1])
                count += _process(args, lines, part, dtype, pool, not args.quiet)
                parts.append(part)
            for key, prefix in outputs.items():
                merged = IndexedDatasetBuilder(data_file_path(prefix), dtype=dtype)
                for part in parts:
                    merged.add_index(part[key])
                merged.finalize(index_file_path(prefix))
                for part in parts:
                    os.unlink(data_file_path(part[key]))
                    os.unlink(index_file_path(part[key]))
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    if not args.quiet:
        dt = time.perf_counter() - start
        names = ", ".join(outputs.values())
        print(
            f"wrote {count} documents in {dt:.1f} s with {args.workers} worker(s): {names}",
            file=sys.stderr,
        )
    return outputs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pentatron-preprocess-data", description=__doc__.split("\n")[0]
    )
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="path to a jsonl file, one document per line")
    g.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys to extract from each record"
    )
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="PentatronBPETokenizer", choices=TOKENIZER_TYPES)
    add_tokenizer_file_args(g)
    g.add_argument(
        "--append-eod",
        action="store_true",
        help="append the end-of-document token to each document",
    )
    g = p.add_argument_group("output data")
    g.add_argument(
        "--output-prefix", required=True, help="output files: <prefix>_<key>_document.bin/.idx"
    )
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument(
        "--partitions", type=int, default=1, help="split the input into this many parts, then merge"
    )
    g.add_argument(
        "--log-interval", type=int, default=1000, help="documents between progress lines"
    )
    g.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        preprocess(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
