"""Small tokenizer model files made in a test: a sentencepiece BPE model, GPT-2 style
vocab.json / merges.txt, a word-level Hugging Face tokenizer.json; and the text they cover.
Shared by the tokenizer tests and the Megatron launch-script tests."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven"]
LINES = [" ".join(WORDS[(i * k) % len(WORDS)] for k in range(1, 9)) + f" {i}" for i in range(300)]


def train_sp(path, **ids):
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(LINES),
        model_prefix=str(path),
        vocab_size=120,
        model_type="bpe",
        minloglevel=2,
        **ids,
    )
    return str(path) + ".model"


def gpt2_files(tmp_path, with_eod):
    """GPT-2's byte -> printable-character table as the first 256 entries, a few merges."""
    b2u = {}
    n = 0
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    for b in range(256):
        if b in printable:
            b2u[b] = chr(b)
        else:
            b2u[b] = chr(256 + n)
            n += 1
    vocab = {b2u[b]: i for i, b in enumerate(sorted(b2u, key=lambda b: (b not in printable, b)))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("in", "g"), ("Ġ", "f")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    if with_eod:
        vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    )
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), len(vocab)


def hf_word_level(folder: Path) -> Path:
    """A word-level tokenizer.json whose post-processor adds <s> (like Llama's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.add_special_tokens(["<unk>", "<s>", "</s>"])
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    return folder
