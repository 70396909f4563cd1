"""Tokenizers: byte fallback, NullTokenizer, BPE training, Hugging Face loading, the factory."""

import json

import pytest

from pentatron.pretrain.tokenizer import (
    ByteLevelTokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    build_tokenizer,
    train_bpe_tokenizer,
)
from pentatron.pretrain.tokenizer.train import main as train_main

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "Größe, naïve café — 日本語 ✓ emoji 🐍\n",
    "class Foo:\n    pass\n" * 20,
] * 10


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("bpe")
    train_bpe_tokenizer(TEXTS, out, vocab_size=300, min_frequency=1)
    return out


def test_byte_level_round_trip():
    tok = ByteLevelTokenizer()
    for text in TEXTS[:3]:
        ids = tok.tokenize(text)
        assert max(ids) < 256 and tok.detokenize(ids) == text
    assert (tok.vocab_size, tok.eod, tok.pad) == (258, 256, 257)
    assert tok.detokenize([104, 105, tok.eod]) == "hi"


def test_null_tokenizer():
    tok = NullTokenizer(100)
    assert tok.tokenize("1 2  30") == [1, 2, 30]
    assert tok.detokenize([4, 5]) == "4 5"
    assert (tok.vocab_size, tok.eod) == (100, 99)  # Megatron's: eod = vocab_size - 1


def test_trained_bpe_round_trips_and_compresses(bpe_dir):
    tok = HuggingFaceTokenizer(bpe_dir)
    assert tok.vocab_size == 300
    assert tok.eod == 0 and tok.pad == 1  # <|endoftext|>, <|pad|>
    for text in TEXTS[:3]:
        ids = tok.tokenize(text)
        assert tok.detokenize(ids) == text
    assert len(tok.tokenize(TEXTS[2])) < len(TEXTS[2].encode()) / 3
    # the file alone loads the same tokenizer
    same = HuggingFaceTokenizer(bpe_dir / "tokenizer.json")
    assert same.tokenize(TEXTS[0]) == tok.tokenize(TEXTS[0])
    # special tokens are one id each
    assert tok.tokenize("<|endoftext|>") == [0]


def test_training_is_deterministic(bpe_dir, tmp_path):
    train_bpe_tokenizer(TEXTS, tmp_path, vocab_size=300, min_frequency=1)
    assert (tmp_path / "tokenizer.json").read_text() == (bpe_dir / "tokenizer.json").read_text()


def test_train_cli(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    assert (
        train_main(
            [
                "--input",
                str(data),
                "--vocab-size",
                "280",
                "--output-dir",
                str(tmp_path / "t"),
                "--quiet",
            ]
        )
        == 0
    )
    assert "vocab_size=280" in capsys.readouterr().out
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "t"))
    assert tok.detokenize(tok.tokenize(TEXTS[1])) == TEXTS[1]
    assert (
        train_main(
            ["--input", str(tmp_path / "missing.jsonl"), "--output-dir", str(tmp_path / "u")]
        )
        == 2
    )
    assert "--input" in capsys.readouterr().err


def test_gpt2_style_vocab_and_merges(bpe_dir, tmp_path):
    model = json.loads((bpe_dir / "tokenizer.json").read_text())["model"]
    (tmp_path / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    tok = build_tokenizer(
        "GPT2BPETokenizer",
        vocab_file=str(tmp_path / "vocab.json"),
        merge_file=str(tmp_path / "merges.txt"),
    )
    ref = HuggingFaceTokenizer(bpe_dir)
    assert tok.tokenize(TEXTS[0]) == ref.tokenize(TEXTS[0]) and tok.eod == ref.eod


def test_factory_errors(tmp_path):
    with pytest.raises(
        ValueError, match="--tokenizer-type=HuggingFaceTokenizer: needs --tokenizer-model"
    ):
        build_tokenizer("HuggingFaceTokenizer")
    with pytest.raises(ValueError, match="--tokenizer-type=SentencePiece: not a supported"):
        build_tokenizer("SentencePiece")
    with pytest.raises(ValueError, match="needs --vocab-size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(FileNotFoundError, match="--tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "none"))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid Hugging Face tokenizer"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    assert isinstance(build_tokenizer("ByteLevelTokenizer"), ByteLevelTokenizer)
