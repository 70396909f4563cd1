"""The embedded default corpus: this Python's own standard-library sources, tokenized.

With no data flags the app trains on real text that exists on every machine: the `.py` files
of `sysconfig.get_paths()["stdlib"]` (sorted by relative path, tests, `idlelib`,
`site-packages` and caches left out, at most `max_bytes` of text). `prepare_embedded_corpus`
trains a byte-level BPE on them, tokenizes each file as one document followed by
`<|endoftext|>`, and stores both under

    <cache>/corpus/py<major.minor>-<hash>/
        tokenizer/tokenizer.json
        stdlib_text_document.bin / .idx
        manifest.json            (written last: the cache is complete iff it exists)

where `<cache>` is `$PENTATRON_CACHE` or `~/.cache/pentatron`, and `<hash>` is the md5 of the
manifest of inputs (each file's path, size and sha256, the vocabulary size, the builder
version). A second call only reads `manifest.json`. Concurrent callers (ranks, processes)
serialize on a file lock and build once; the folder appears with one atomic rename.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._files import build_once, config_hash, save_json
from .indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

BUILDER_VERSION = 1
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
DATA_NAME = "stdlib_text_document"
_EXCLUDED_DIRS = {
    "site-packages",
    "dist-packages",
    "__pycache__",
    "idlelib",
    "test",
    "tests",
    "idle_test",
}


def default_cache_dir() -> Path:
    env = os.environ.get("PENTATRON_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pentatron"


def stdlib_source_files(
    max_bytes: int = DEFAULT_MAX_BYTES, root: str | None = None
) -> list[tuple[str, Path]]:
    """(relative path, path) of the stdlib's `.py` files in sorted order, up to `max_bytes` in all."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [
            d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith(("test", "."))
        ]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(base).as_posix(), path))
    found.sort()
    chosen, total = [], 0
    for rel, path in found:
        size = path.stat().st_size
        if total + size > max_bytes:
            continue
        chosen.append((rel, path))
        total += size
    if not chosen:
        raise RuntimeError(f"no Python sources found under {base} for the embedded corpus")
    return chosen


def input_manifest(files, vocab_size: int) -> dict:
    entries = []
    for rel, path in files:
        data = path.read_bytes()
        entries.append([rel, len(data), hashlib.sha256(data).hexdigest()])
    return {
        "builder_version": BUILDER_VERSION,
        "python": sys.version.split()[0],
        "vocab_size": vocab_size,
        "files": entries,
    }


@dataclass(frozen=True)
class EmbeddedCorpus:
    root: Path
    data_prefix: str  # pass as --data-path
    tokenizer_dir: str  # pass as --tokenizer-model
    num_documents: int
    num_tokens: int
    text_bytes: int
    build_seconds: float  # of the build that made this cache (0 if never measured)

    def dataset(self) -> IndexedDataset:
        return IndexedDataset(self.data_prefix)


def prepare_embedded_corpus(
    cache_dir: str | os.PathLike[str] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_bytes: int = DEFAULT_MAX_BYTES,
    group=None,
    stdlib_root: str | None = None,
) -> EmbeddedCorpus:
    """Build (once) or open the cached embedded corpus; see the module docstring.

    `group`: an optional torch.distributed group; its first rank builds while the others wait.
    """
    files = stdlib_source_files(max_bytes, stdlib_root)
    manifest = input_manifest(files, vocab_size)
    key = config_hash(manifest)[:16]
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root = base / "corpus" / f"py{sys.version_info.major}.{sys.version_info.minor}-{key}"
    done = root / "manifest.json"

    def build() -> None:
        _build(root, files, manifest, vocab_size)

    build_once(base / "corpus" / f".{root.name}.lock", done.is_file, build, group=group)
    info = json.loads(done.read_text())
    return EmbeddedCorpus(
        root=root,
        data_prefix=str(root / DATA_NAME),
        tokenizer_dir=str(root / "tokenizer"),
        num_documents=info["num_documents"],
        num_tokens=info["num_tokens"],
        text_bytes=info["text_bytes"],
        build_seconds=info["build_seconds"],
    )


def _build(root: Path, files, manifest: dict, vocab_size: int) -> None:
    from ..tokenizer.huggingface import HuggingFaceTokenizer
    from ..tokenizer.train import train_bpe_tokenizer

    start = time.perf_counter()
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    try:
        texts = [path.read_text(encoding="utf-8", errors="replace") for _, path in files]
        train_bpe_tokenizer(texts, tmp / "tokenizer", vocab_size=vocab_size)
        tokenizer = HuggingFaceTokenizer(tmp / "tokenizer")
        dtype = DType.optimal_dtype(tokenizer.vocab_size)
        builder = IndexedDatasetBuilder(tmp / f"{DATA_NAME}.bin", dtype=dtype)
        num_tokens = 0
        for ids in tokenizer.tokenize_batch(texts):
            ids.append(tokenizer.eod)
            builder.add_item(np.asarray(ids, dtype=dtype))
            builder.end_document()
            num_tokens += len(ids)
        builder.finalize(tmp / f"{DATA_NAME}.idx")
        info = dict(manifest)
        info.update(
            num_documents=len(texts),
            num_tokens=num_tokens,
            text_bytes=sum(f[1] for f in manifest["files"]),
            build_seconds=round(time.perf_counter() - start, 3),
            built_by_pid=os.getpid(),
        )
        save_json(tmp / "manifest.json", info)
        if root.exists():  # an incomplete leftover (no manifest): replace it
            shutil.rmtree(root)
        os.replace(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> int:
    """`python -m pentatron.pretrain.data.embedded_corpus [--cache-dir DIR]`: build and print paths."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m pentatron.pretrain.data.embedded_corpus")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    args = p.parse_args(argv)
    t = time.perf_counter()
    corpus = prepare_embedded_corpus(args.cache_dir, vocab_size=args.vocab_size)
    print(
        f"--data-path {corpus.data_prefix} --tokenizer-model {corpus.tokenizer_dir}\n"
        f"{corpus.num_documents} documents, {corpus.text_bytes / 1e6:.1f} MB text, {corpus.num_tokens} tokens; "
        f"built in {corpus.build_seconds:.1f} s, this call {time.perf_counter() - t:.2f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
