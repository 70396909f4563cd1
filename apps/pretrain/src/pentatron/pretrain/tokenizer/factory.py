"""`build_tokenizer`: a tokenizer from Megatron's `--tokenizer-type` / `--tokenizer-model` flags."""

from __future__ import annotations

from .base import Tokenizer
from .byte_level import ByteLevelTokenizer, NullTokenizer
from .huggingface import HuggingFaceTokenizer

TOKENIZER_TYPES = (
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    "PentatronBPETokenizer",
    "ByteLevelTokenizer",
    "NullTokenizer",
)


def build_tokenizer(
    tokenizer_type: str = "PentatronBPETokenizer",
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    cache_dir: str | None = None,
) -> Tokenizer:
    """Megatron's flag semantics:

    - `HuggingFaceTokenizer`: `--tokenizer-model` = a tokenizer.json or an HF tokenizer directory.
    - `GPT2BPETokenizer`: `--vocab-file vocab.json --merge-file merges.txt`.
    - `PentatronBPETokenizer`: a tokenizer.json made by `pentatron-train-tokenizer`; without
      `--tokenizer-model`, the BPE trained on the embedded corpus (built and cached on first use).
    - `ByteLevelTokenizer`: UTF-8 bytes, no files.
    - `NullTokenizer`: space-separated ids, needs `--vocab-size`.
    """
    if tokenizer_type in ("HuggingFaceTokenizer", "PentatronBPETokenizer") and tokenizer_model:
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        raise ValueError(
            "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json or directory)"
        )
    if tokenizer_type == "PentatronBPETokenizer":
        from ..data.embedded_corpus import prepare_embedded_corpus

        return HuggingFaceTokenizer(prepare_embedded_corpus(cache_dir=cache_dir).tokenizer_dir)
    if tokenizer_type == "GPT2BPETokenizer":
        if not (vocab_file and merge_file):
            raise ValueError(
                "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"
            )
        return _gpt2_bpe(vocab_file, merge_file)
    if tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise ValueError(
        f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of {', '.join(TOKENIZER_TYPES)}"
    )


def _gpt2_bpe(vocab_file: str, merge_file: str) -> Tokenizer:
    import os
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for src, name in ((vocab_file, "vocab.json"), (merge_file, "merges.txt")):
            if not os.path.isfile(src):
                raise FileNotFoundError(
                    f"--{'vocab' if name == 'vocab.json' else 'merge'}-file {src}: no such file"
                )
            shutil.copy(src, os.path.join(tmp, name))
        return HuggingFaceTokenizer(tmp)
