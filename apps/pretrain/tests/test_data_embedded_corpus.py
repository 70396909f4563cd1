"""The embedded stdlib corpus: real text, built once, cached, safe under concurrent ranks."""

import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch.distributed as dist

from pentatron.pretrain.data.embedded_corpus import prepare_embedded_corpus, stdlib_source_files
from pentatron.pretrain.tokenizer import HuggingFaceTokenizer, build_tokenizer

SMALL = 600_000  # bytes of source: keeps the test build around a second


def test_source_selection_is_deterministic_and_bounded():
    files = stdlib_source_files(SMALL)
    assert files == stdlib_source_files(SMALL)
    assert [r for r, _ in files] == sorted(r for r, _ in files)
    assert sum(p.stat().st_size for _, p in files) <= SMALL
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for rel, path in files:
        parts = rel.split("/")
        assert rel.endswith(".py") and path == stdlib / rel
        assert not any(p in ("site-packages", "test", "tests", "__pycache__") for p in parts)
    full = stdlib_source_files()
    assert sum(p.stat().st_size for _, p in full) > 4_000_000  # a real corpus by default


def test_build_round_trip_and_cache(tmp_path):
    corpus = prepare_embedded_corpus(tmp_path, vocab_size=512, max_bytes=SMALL)
    files = stdlib_source_files(SMALL)
    ds = corpus.dataset()
    tok = HuggingFaceTokenizer(corpus.tokenizer_dir)
    assert tok.vocab_size == 512 and ds.dtype == np.uint16
    assert corpus.num_documents == len(ds) == len(files)
    assert corpus.num_tokens == int(ds.sequence_lengths.sum())
    for i in (0, len(files) // 2, len(files) - 1):
        ids = ds[i]
        assert ids[-1] == tok.eod
        assert tok.detokenize(ids[:-1]) == files[i][1].read_text(encoding="utf-8")
    # second call: no rebuild, same answer
    before = os.stat(corpus.data_prefix + ".bin").st_mtime_ns
    again = prepare_embedded_corpus(tmp_path, vocab_size=512, max_bytes=SMALL)
    assert again == corpus and os.stat(corpus.data_prefix + ".bin").st_mtime_ns == before
    # a different vocabulary is a different cache entry; the env var moves the default cache
    other = prepare_embedded_corpus(tmp_path, vocab_size=600, max_bytes=SMALL)
    assert other.root != corpus.root and HuggingFaceTokenizer(other.tokenizer_dir).vocab_size == 600
    assert sorted(
        p.name for p in (tmp_path / "corpus").iterdir() if not p.name.startswith(".")
    ) == sorted([corpus.root.name, other.root.name])


def test_default_tokenizer_uses_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PENTATRON_CACHE", str(tmp_path))
    corpus = prepare_embedded_corpus(vocab_size=512, max_bytes=SMALL)
    assert str(corpus.root).startswith(str(tmp_path))
    tok = build_tokenizer("PentatronBPETokenizer", corpus.tokenizer_dir)
    assert tok.vocab_size == 512


def _prepare_on_ranks(cache, use_group):
    corpus = prepare_embedded_corpus(
        cache, vocab_size=300, max_bytes=200_000, group=dist.group.WORLD if use_group else None
    )
    manifest = json.loads((corpus.root / "manifest.json").read_text())
    return str(corpus.root), manifest["built_by_pid"], os.getpid()


def test_concurrent_ranks_build_once(distributed, tmp_path):
    for use_group in (True, False):
        cache = str(tmp_path / f"g{use_group}")
        results = distributed.run(2, _prepare_on_ranks, cache, use_group)
        roots, builders, pids = zip(*results)
        assert len(set(roots)) == 1 and len(set(builders)) == 1 and builders[0] in pids
        if use_group:
            assert builders[0] == pids[0]  # the group's first rank built it
        leftovers = [
            p.name for p in (tmp_path / f"g{use_group}" / "corpus").iterdir() if p.suffix != ".lock"
        ]
        assert leftovers == [Path(roots[0]).name]  # no temp folders left behind
