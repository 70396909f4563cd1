"""Megatron's `--tokenizer-type`s (Megatron-LM d98e8a64, megatron/core/tokenizers): each on a
tiny model file made here, checked against the backing library used directly and against
Megatron's id rules written out below."""

import base64
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _tokenizer_files import LINES, gpt2_files, hf_word_level, train_sp

from pentatron.pretrain.tokenizer import (
    TOKENIZER_TYPES,
    NullTokenizer,
    SentencePieceTokenizer,
    TikTokenizer,
    build_tokenizer,
)

spm = pytest.importorskip("sentencepiece")
tiktoken = pytest.importorskip("tiktoken")

TEXT = "the lazy fox hums over 42 brown dogs"

SP_TYPES = ("GPTSentencePieceTokenizer", "Llama2Tokenizer", "SentencePieceTokenizer")


@pytest.fixture(scope="module")
def sp_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    return {
        "default": train_sp(d / "default"),  # unk 0, bos 1, eos 2, no pad
        "custom": train_sp(d / "custom", unk_id=3, bos_id=0, eos_id=1, pad_id=2),
        "no_eos": train_sp(d / "no_eos", eos_id=-1),
    }


def megatron_sp_rules(sp):
    """Megatron's SentencePieceTokenizer (legacy=False), the same for all three type names."""
    return {
        "vocab_size": sp.get_piece_size(),
        "eod": sp.eos_id(),
        "eos": sp.eos_id(),
        "bos": sp.bos_id(),
        "pad": sp.pad_id(),  # -1 when the model has no pad piece
    }


@pytest.mark.parametrize("tokenizer_type", SP_TYPES)
@pytest.mark.parametrize("which", ["default", "custom"])
def test_sentencepiece_types_match_sentencepiece(sp_models, tokenizer_type, which):
    model = sp_models[which]
    sp = spm.SentencePieceProcessor(model_file=model)
    rules = megatron_sp_rules(sp)
    tok = build_tokenizer(tokenizer_type, model)
    assert isinstance(tok, SentencePieceTokenizer) and tok.name == tokenizer_type
    assert (tok.vocab_size, tok.eod, tok.eos, tok.bos, tok.pad_id) == (
        rules["vocab_size"],
        rules["eod"],
        rules["eos"],
        rules["bos"],
        rules["pad"],
    )
    # Pentatron's pad is a real id: the model's pad, else eod
    assert tok.pad == (rules["pad"] if rules["pad"] >= 0 else rules["eod"])
    for text in (TEXT, LINES[7]):
        ids = tok.tokenize(text)
        assert ids == sp.encode_as_ids(text)  # no BOS/EOS added (Llama2Tokenizer included)
        assert tok.detokenize(ids) == sp.decode_ids(ids) == text
    assert tok.tokenize_batch([TEXT, LINES[0]]) == [tok.tokenize(TEXT), tok.tokenize(LINES[0])]
    assert tok.vocab_size < 150  # the tiny model, not a default size


def test_sentencepiece_default_ids(sp_models):
    tok = build_tokenizer("Llama2Tokenizer", sp_models["default"])
    assert (tok.bos, tok.eod, tok.pad_id, tok.pad, tok.unk) == (1, 2, -1, 2, 0)
    tok = build_tokenizer("GPTSentencePieceTokenizer", sp_models["custom"])
    assert (tok.bos, tok.eod, tok.pad, tok.unk) == (0, 1, 2, 3)


def test_sentencepiece_errors(sp_models, tmp_path):
    for t in SP_TYPES:
        with pytest.raises(ValueError, match=f"--tokenizer-type={t}: needs --tokenizer-model"):
            build_tokenizer(t)
    with pytest.raises(FileNotFoundError, match=r"--tokenizer-model=.*no such file.*fix:"):
        build_tokenizer("Llama2Tokenizer", str(tmp_path / "missing.model"))
    (tmp_path / "bad.model").write_bytes(b"not a protobuf at all")
    with pytest.raises(ValueError, match=r"--tokenizer-model=.*not a sentencepiece model.*fix:"):
        build_tokenizer("GPTSentencePieceTokenizer", str(tmp_path / "bad.model"))
    with pytest.raises(ValueError, match=r"no end-of-sentence piece.*fix: train .* eos"):
        build_tokenizer("Llama2Tokenizer", sp_models["no_eos"])
    with pytest.raises(ValueError, match=r"--tokenizer-special-tokens=<x>: .*fix:"):
        build_tokenizer("Llama2Tokenizer", sp_models["default"], special_tokens=["<x>"])


# --- TikTokenizer ---------------------------------------------------------------------------

# Megatron's regexes, copied from tiktoken_tokenizer.py
PATTERN_V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
PATTERN_V2 = (
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|"
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|"
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
MEGATRON_SPECIALS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
MERGES = [b"th", b"he", b"the", b" t", b" the", b"oW", b"in", b"ing", b"er", b" f", b"ox", b" fox"]
RANKS = {bytes([i]): i for i in range(256)} | {m: 256 + i for i, m in enumerate(MERGES)}
TT_TEXT = "the fox HelloWorld thing <s> over</s> 12 éè 🐍\n"


@pytest.fixture(scope="module")
def tiktoken_vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("tt") / "vocab.json"
    entries = [
        {
            "rank": r,
            "token_bytes": base64.b64encode(t).decode(),
            "token_str": t.decode("utf-8", errors="replace"),
        }
        for t, r in sorted(RANKS.items(), key=lambda kv: kv[1])
    ]
    path.write_text(json.dumps(entries))
    return str(path)


def _reference(pattern, n_special, specials, inner):
    """tiktoken used directly: Megatron's layout (specials first, file rank r -> r + n)."""
    names = specials + [f"<SPECIAL_{i}>" for i in range(len(specials), n_special)]
    return tiktoken.Encoding(
        name="ref",
        pat_str=pattern,
        mergeable_ranks={t: r + n_special for t, r in RANKS.items() if r < inner},
        special_tokens={t: i for i, t in enumerate(names)},
    )


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktokenizer_matches_tiktoken(tiktoken_vocab, pattern):
    n = 16
    vocab_size = n + len(RANKS)
    tok = build_tokenizer(
        "TikTokenizer",
        tiktoken_vocab,
        vocab_size=vocab_size,
        tiktoken_pattern=pattern,
        tiktoken_num_special_tokens=n,
    )
    assert isinstance(tok, TikTokenizer)
    ref = _reference(PATTERN_V1 if pattern == "v1" else PATTERN_V2, n, MEGATRON_SPECIALS, 10**9)
    ids = tok.tokenize(TT_TEXT)
    assert ids == ref.encode(TT_TEXT, allowed_special="all")
    assert tok.detokenize(ids) == TT_TEXT
    # Megatron's layout: specials at their list positions, file ranks shifted by n
    assert tok.vocab_size == vocab_size
    assert (tok.unk, tok.bos, tok.eos, tok.eod, tok.pad) == (0, 1, 2, 2, 4)
    assert tok.tokenize("the") == [RANKS[b"the"] + n]
    assert tok.tokenize(" fox") == [RANKS[b" fox"] + n]
    assert tok.tokenize("\x00") == [n]
    assert tok.tokenize("<s>x</s><SPECIAL_9>") == [1, ord("x") + n, 2, 9]
    # v1 keeps "HelloWorld" one piece (so the oW merge applies), v2 splits it at the capital
    has_ow = RANKS[b"oW"] + n in tok.tokenize("HelloWorld")
    assert has_ow == (pattern == "v1")


def test_tiktokenizer_megatron_defaults(tiktoken_vocab):
    """Default pattern v2, 1000 special tokens; --vocab-size cuts the file's ranks."""
    tok = build_tokenizer("TikTokenizer", tiktoken_vocab, vocab_size=1000 + len(RANKS))
    ref = _reference(PATTERN_V2, 1000, MEGATRON_SPECIALS, 10**9)
    assert tok.tokenize(TT_TEXT) == ref.encode(TT_TEXT, allowed_special="all")
    assert tok.tokenize("a") == [1000 + ord("a")] and tok.eod == 2
    assert tok.tokenize("<SPECIAL_999>") == [999]
    short = build_tokenizer("TikTokenizer", tiktoken_vocab, vocab_size=1000 + 258)
    assert short.vocab_size == 1258
    cut = _reference(PATTERN_V2, 1000, MEGATRON_SPECIALS, 258)  # "th", "he" only
    assert short.tokenize("the thing") == cut.encode("the thing", allowed_special="all")
    assert short.tokenize("the") == [1000 + 256, 1000 + ord("e")]


def test_tiktokenizer_custom_special_tokens(tiktoken_vocab):
    specials = ["<s>", "</s>", "<|im_start|>", "<unk>", "<pad>", "<mask>", "<cls>", "<sep>"]
    tok = build_tokenizer(
        "TikTokenizer",
        tiktoken_vocab,
        vocab_size=10 + len(RANKS),
        tiktoken_num_special_tokens=10,
        special_tokens=specials,
    )
    assert (tok.bos, tok.eod, tok.unk, tok.pad) == (0, 1, 3, 4)
    assert tok.tokenize("<|im_start|>hi") == [2, ord("h") + 10, ord("i") + 10]
    ref = _reference(PATTERN_V2, 10, specials, 10**9)
    assert tok.tokenize(TT_TEXT) == ref.encode(TT_TEXT, allowed_special="all")


def test_tiktokenizer_errors(tiktoken_vocab, tmp_path):
    with pytest.raises(ValueError, match=r"--tokenizer-type=TikTokenizer: needs --tokenizer-model"):
        build_tokenizer("TikTokenizer")
    with pytest.raises(FileNotFoundError, match=r"--tokenizer-model=.*no such file.*fix:"):
        build_tokenizer("TikTokenizer", str(tmp_path / "none.json"), vocab_size=300)
    with pytest.raises(
        ValueError, match=r"--tiktoken-pattern=v3: .*fix: pass --tiktoken-pattern v1"
    ):
        build_tokenizer("TikTokenizer", tiktoken_vocab, vocab_size=300, tiktoken_pattern="v3")
    # the file has 268 ranks; Megatron's default vocab_size 131072 needs 130072
    with pytest.raises(
        ValueError, match=r"--vocab-size=None \(default 131072\).*fix: pass --vocab-size 1268"
    ):
        build_tokenizer("TikTokenizer", tiktoken_vocab)
    with pytest.raises(ValueError, match=r"--tokenizer-special-tokens=.*missing <pad>"):
        build_tokenizer(
            "TikTokenizer",
            tiktoken_vocab,
            vocab_size=1200,
            special_tokens=["<unk>", "<s>", "</s>", "<mask>", "<cls>", "<sep>"],
        )
    with pytest.raises(ValueError, match=r"--tiktoken-num-special-tokens=4: .*fix:"):
        build_tokenizer(
            "TikTokenizer", tiktoken_vocab, vocab_size=200, tiktoken_num_special_tokens=4
        )
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"rank": 1, "token_bytes": "AA==", "token_str": "\x00"}]))
    with pytest.raises(ValueError, match=r"not a Megatron tiktoken vocab \(entry 0 has rank 1"):
        build_tokenizer("TikTokenizer", str(bad), vocab_size=1001)
    (tmp_path / "v.txt").write_text("[]")
    with pytest.raises(ValueError, match=r"must end in \.json"):
        build_tokenizer("TikTokenizer", str(tmp_path / "v.txt"), vocab_size=1001)


# --- GPT2BPETokenizer, HuggingFaceTokenizer ---------------------------------------------------


@pytest.mark.parametrize("with_eod", [True, False])
def test_gpt2_bpe_matches_hf_gpt2_tokenizer(tmp_path, with_eod):
    """Megatron's GPT2BPETokenizer is HF's GPT2Tokenizer on --vocab-file/--merge-file."""
    transformers = pytest.importorskip("transformers")
    vocab_file, merge_file, n = gpt2_files(tmp_path, with_eod)
    ref = transformers.GPT2Tokenizer(vocab=vocab_file, merges=merge_file)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    text = "hello the thing, the fox<|endoftext|> 日本"
    assert tok.tokenize(text) == ref(text).input_ids
    assert tok.detokenize(tok.tokenize(text)) == text
    # <|endoftext|> is the eod; appended as a new id when the vocab lacks it
    assert tok.vocab_size == len(ref) == (n if with_eod else n + 1)
    assert tok.eod == ref.eos_token_id == (n - 1 if with_eod else n)


def test_gpt2_bpe_errors(tmp_path):
    with pytest.raises(ValueError, match=r"needs --vocab-file and --merge-file; fix:"):
        build_tokenizer("GPT2BPETokenizer", vocab_file="v.json")
    vocab_file, _, _ = gpt2_files(tmp_path, True)
    with pytest.raises(FileNotFoundError, match=r"--merge-file=.*: no such file; fix:"):
        build_tokenizer(
            "GPT2BPETokenizer", vocab_file=vocab_file, merge_file=str(tmp_path / "m.txt")
        )


@pytest.fixture
def hf_with_bos(tmp_path):
    return hf_word_level(tmp_path)


def test_hf_include_special_tokens_and_extra_specials(hf_with_bos):
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(hf_with_bos / "tokenizer.json"), bos_token="<s>", eos_token="</s>"
    )
    text = "the lazy dog"
    tok = build_tokenizer("HuggingFaceTokenizer", str(hf_with_bos))
    assert tok.tokenize(text) == ref(text).input_ids == [1, 3, 10, 11]
    assert (tok.bos, tok.eod, tok.vocab_size) == (1, 2, len(ref))
    plain = build_tokenizer(
        "HuggingFaceTokenizer", str(hf_with_bos), tokenizer_hf_no_include_special_tokens=True
    )
    assert plain.tokenize(text) == ref(text, add_special_tokens=False).input_ids == [3, 10, 11]
    # --tokenizer-special-tokens: new ones appended after the vocab, existing ones keep their id
    extra = build_tokenizer(
        "HuggingFaceTokenizer", str(hf_with_bos), special_tokens=["<|im_start|>", "</s>"]
    )
    ref.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "</s>"]})
    assert extra.vocab_size == len(ref) == tok.vocab_size + 1
    assert extra.tokenize("the <|im_start|> dog") == ref("the <|im_start|> dog").input_ids
    assert extra.tokenize("<|im_start|>") == [1, tok.vocab_size]


# --- NullTokenizer, factory ---------------------------------------------------------------------


def test_null_tokenizer_megatron_semantics():
    tok = build_tokenizer("NullTokenizer", vocab_size=512)
    assert isinstance(tok, NullTokenizer)
    assert (tok.vocab_size, tok.eod, tok.pad_id, tok.pad) == (512, 511, -1, 511)
    assert tok.tokenize("3 1 4") == [3, 1, 4] and tok.detokenize([2, 7]) == "2 7"
    tok = build_tokenizer(
        "NullTokenizer", vocab_size=512, null_tokenizer_eod_id=0, null_tokenizer_pad_id=5
    )
    assert (tok.vocab_size, tok.eod, tok.pad) == (512, 0, 5)
    with pytest.raises(ValueError, match=r"--null-tokenizer-eod-id=512: .*fix:"):
        build_tokenizer("NullTokenizer", vocab_size=512, null_tokenizer_eod_id=512)
    with pytest.raises(ValueError, match=r"--null-tokenizer-pad-id=600: .*fix:"):
        build_tokenizer("NullTokenizer", vocab_size=512, null_tokenizer_pad_id=600)
    with pytest.raises(ValueError, match=r"--vocab-size=0: .*fix:"):
        build_tokenizer("NullTokenizer", vocab_size=0)


def test_unknown_type_names_the_choices():
    with pytest.raises(
        ValueError, match=r"--tokenizer-type=Foo: not a supported .*fix: choose one of"
    ):
        build_tokenizer("Foo")
    assert set(SP_TYPES) | {"TikTokenizer", "GPT2BPETokenizer", "NullTokenizer"} <= set(
        TOKENIZER_TYPES
    )
