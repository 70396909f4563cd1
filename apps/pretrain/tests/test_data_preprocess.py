"""pentatron-preprocess-data: jsonl -> .bin/.idx that gives back every token."""

import json

import numpy as np
import pytest

from pentatron.pretrain.data.indexed_dataset import IndexedDataset
from pentatron.pretrain.data.preprocess import main
from pentatron.pretrain.tokenizer import (
    ByteLevelTokenizer,
    HuggingFaceTokenizer,
    train_bpe_tokenizer,
)

DOCS = [f"document {i}: " + "naïve 🐍 text " * (i % 7) + "\n" * (i % 3) for i in range(120)]
DOCS[5] = ""  # an empty document stays a (zero-sequence) document, as in Megatron


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pre")
    with open(root / "in.jsonl", "w", encoding="utf-8") as f:
        for i, d in enumerate(DOCS):
            f.write(json.dumps({"text": d, "title": f"t{i}"}) + "\n")
    train_bpe_tokenizer(DOCS, root / "tok", vocab_size=320, min_frequency=1)
    return root


def _run(inputs, out, *extra):
    argv = [
        "--input",
        str(inputs / "in.jsonl"),
        "--output-prefix",
        str(out),
        "--append-eod",
        "--quiet",
    ]
    return main(argv + list(extra))


def _expected(tok, text, eod=True):
    ids = tok.tokenize(text)
    return [*ids, tok.eod] if ids and eod else ids


def test_round_trip_every_token_hf(inputs, tmp_path):
    tok = HuggingFaceTokenizer(inputs / "tok")
    args = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(inputs / "tok")]
    assert _run(inputs, tmp_path / "w1", *args, "--json-keys", "text", "title") == 0
    ds = IndexedDataset(tmp_path / "w1_text_document")
    assert ds.num_documents == len(DOCS) and ds.dtype == np.uint16
    docs = ds.document_indices
    for i, text in enumerate(DOCS):
        seqs = [ds[j].tolist() for j in range(docs[i], docs[i + 1])]
        got = [t for s in seqs for t in s]
        assert got == _expected(tok, text)
        if text:
            assert tok.detokenize(got[:-1]) == text
    titles = IndexedDataset(tmp_path / "w1_title_document")
    assert [titles[i].tolist() for i in range(3)] == [_expected(tok, f"t{i}") for i in range(3)]

    # two workers, and two partitions merged, give the identical files
    assert _run(inputs, tmp_path / "w2", *args, "--workers", "2", "--partitions", "2") == 0
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w2_text_document{ext}").read_bytes() == (
            tmp_path / f"w1_text_document{ext}"
        ).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("w2")) == [
        "w2_text_document.bin",
        "w2_text_document.idx",
    ]


def test_byte_level_without_eod(inputs, tmp_path):
    argv = [
        "--input",
        str(inputs / "in.jsonl"),
        "--output-prefix",
        str(tmp_path / "b"),
        "--quiet",
        "--tokenizer-type",
        "ByteLevelTokenizer",
    ]
    assert main(argv) == 0
    ds = IndexedDataset(tmp_path / "b_text_document")
    tok = ByteLevelTokenizer()
    assert [ds[i].tolist() for i in range(4)] == [_expected(tok, d, eod=False) for d in DOCS[:4]]


def test_progress_output(inputs, tmp_path, capsys):
    argv = [
        "--input",
        str(inputs / "in.jsonl"),
        "--output-prefix",
        str(tmp_path / "p"),
        "--tokenizer-type",
        "ByteLevelTokenizer",
        "--log-interval",
        "50",
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert (
        "processed 50 documents" in err
        and "processed 100 documents" in err
        and "wrote 120 documents" in err
    )


@pytest.mark.parametrize(
    "line, message",
    [
        ("{broken", "line 2: not valid JSON"),
        ('{"body": "x"}', "line 2: --json-keys key 'text' missing"),
    ],
)
def test_bad_input_is_one_line_error(tmp_path, capsys, line, message):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n' + line + "\n")
    argv = [
        "--input",
        str(tmp_path / "bad.jsonl"),
        "--output-prefix",
        str(tmp_path / "o"),
        "--quiet",
        "--tokenizer-type",
        "ByteLevelTokenizer",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err and "bad.jsonl" in err
    assert not list(tmp_path.glob("o_*"))  # nothing half-written at the output path


def test_missing_input_and_tokenizer_errors(tmp_path, capsys):
    assert (
        main(["--input", str(tmp_path / "none.jsonl"), "--output-prefix", str(tmp_path / "o")]) == 2
    )
    assert "--input" in capsys.readouterr().err
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    argv = [
        "--input",
        str(tmp_path / "a.jsonl"),
        "--output-prefix",
        str(tmp_path / "o"),
        "--tokenizer-type",
        "HuggingFaceTokenizer",
    ]
    assert main(argv) == 2
    assert "needs --tokenizer-model" in capsys.readouterr().err


def _words_jsonl(path):
    from _tokenizer_files import LINES

    with open(path, "w", encoding="utf-8") as f:
        for line in LINES[:40]:
            f.write(json.dumps({"text": line}) + "\n")
    return LINES[:40]


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "GPT2BPETokenizer", "hf-no-specials"])
def test_megatron_tokenizer_types_and_flags(tmp_path, kind):
    """The tokenizer flags are the trainer's (Megatron's preprocess_data.py shares them): each
    type on a model file made here, the ids those of `build_tokenizer` with the same flags."""
    import os
    import sys

    pytest.importorskip("sentencepiece")
    sys.path.insert(0, os.path.dirname(__file__))
    from _tokenizer_files import gpt2_files, hf_word_level, train_sp

    from pentatron.pretrain.tokenizer import build_tokenizer

    lines = _words_jsonl(tmp_path / "in.jsonl")
    if kind == "Llama2Tokenizer":
        model = train_sp(tmp_path / "sp")
        flags = ["--tokenizer-type", kind, "--tokenizer-model", model]
        tok = build_tokenizer(kind, model)
    elif kind == "GPT2BPETokenizer":
        vocab, merges, _ = gpt2_files(tmp_path, with_eod=True)
        flags = ["--tokenizer-type", kind, "--vocab-file", vocab, "--merge-file", merges]
        tok = build_tokenizer(kind, vocab_file=vocab, merge_file=merges)
    else:
        folder = str(hf_word_level(tmp_path / "hf"))
        flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", folder]
        flags.append("--tokenizer-hf-no-include-special-tokens")
        tok = build_tokenizer(
            "HuggingFaceTokenizer", folder, tokenizer_hf_no_include_special_tokens=True
        )
        with_bos = build_tokenizer("HuggingFaceTokenizer", folder)
        assert with_bos.tokenize(lines[0])[1:] == tok.tokenize(lines[0])  # the flag matters
    out = tmp_path / "out"
    argv = ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(out), "--quiet"]
    assert main([*argv, "--append-eod", *flags]) == 0
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert [ds[i].tolist() for i in range(len(lines))] == [_expected(tok, t) for t in lines]
