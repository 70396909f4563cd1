"""`build_tokenizer`: a tokenizer from Megatron's `--tokenizer-type` / `--tokenizer-model` flags."""

from __future__ import annotations

from collections.abc import Sequence

from .base import Tokenizer, flag_error
from .byte_level import ByteLevelTokenizer, NullTokenizer
from .huggingface import HuggingFaceTokenizer
from .sentencepiece_tokenizer import SENTENCEPIECE_TYPES
from .tiktoken_tokenizer import DEFAULT_TIKTOKEN_NUM_SPECIAL_TOKENS, TIKTOKEN_PATTERNS

TOKENIZER_TYPES = (
    "HuggingFaceTokenizer",
    "GPT2BPETokenizer",
    *SENTENCEPIECE_TYPES,
    "TikTokenizer",
    "NullTokenizer",
    "PentatronBPETokenizer",
    "ByteLevelTokenizer",
)
_MODEL_FILE = {
    "HuggingFaceTokenizer": "a tokenizer.json or a Hugging Face tokenizer directory",
    "TikTokenizer": "Megatron's tiktoken .json vocab file",
    **{t: "a sentencepiece .model file" for t in SENTENCEPIECE_TYPES},
}


def build_tokenizer(
    tokenizer_type: str = "PentatronBPETokenizer",
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    cache_dir: str | None = None,
    *,
    special_tokens: Sequence[str] | None = None,
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int = DEFAULT_TIKTOKEN_NUM_SPECIAL_TOKENS,
    null_tokenizer_eod_id: int | None = None,
    null_tokenizer_pad_id: int = -1,
    tokenizer_hf_no_include_special_tokens: bool = False,
) -> Tokenizer:
    """Megatron's flag semantics (keyword names = Megatron's argparse dests):

    - `HuggingFaceTokenizer`: `--tokenizer-model` = a tokenizer.json or an HF tokenizer
      directory; `tokenize` adds the post-processor's BOS/EOS unless
      `--tokenizer-hf-no-include-special-tokens`.
    - `GPT2BPETokenizer`: `--vocab-file vocab.json --merge-file merges.txt`; eod =
      `<|endoftext|>` (a special token, appended when the vocab lacks it).
    - `GPTSentencePieceTokenizer` / `Llama2Tokenizer` / `SentencePieceTokenizer`:
      `--tokenizer-model` = a sentencepiece .model (see `SentencePieceTokenizer`).
    - `TikTokenizer`: `--tokenizer-model` = Megatron's tiktoken JSON vocab,
      `--tiktoken-pattern v1|v2` (default v2), `--tiktoken-num-special-tokens` (1000),
      `--tokenizer-special-tokens`, `--vocab-size` (default 131072) (see `TikTokenizer`).
    - `NullTokenizer`: space-separated ids; vocab_size = `--vocab-size`, eod =
      `--null-tokenizer-eod-id` or vocab_size - 1, `--null-tokenizer-pad-id` (-1: none).
    - `PentatronBPETokenizer`: a tokenizer.json made by `pentatron-train-tokenizer`; without
      `--tokenizer-model`, the BPE trained on the embedded corpus (built and cached on first use).
    - `ByteLevelTokenizer`: UTF-8 bytes, no files.

    `special_tokens` (`--tokenizer-special-tokens`) applies to the Hugging Face, GPT-2 and
    tiktoken types; the sentencepiece types refuse it (as Megatron does without its
    `--tokenizer-sentencepiece-legacy` wrapper); NullTokenizer ignores it.
    """
    specials = list(special_tokens or ())
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(
            flag_error(
                "tokenizer-type",
                tokenizer_type,
                "not a supported tokenizer type",
                f"choose one of {', '.join(TOKENIZER_TYPES)}",
            )
        )
    if tokenizer_type == "TikTokenizer" and tiktoken_pattern not in (None, *TIKTOKEN_PATTERNS):
        raise ValueError(
            flag_error(
                "tiktoken-pattern",
                tiktoken_pattern,
                "TikTokenizer knows the regexes v1 and v2 only",
                "pass --tiktoken-pattern v1 or v2 (the one the vocab was trained with)",
            )
        )
    if tokenizer_type in _MODEL_FILE and not tokenizer_model:
        raise ValueError(
            flag_error(
                "tokenizer-type",
                tokenizer_type,
                f"needs --tokenizer-model ({_MODEL_FILE[tokenizer_type]})",
                f"pass --tokenizer-model PATH to {_MODEL_FILE[tokenizer_type]}",
            )
        )
    include_special = not tokenizer_hf_no_include_special_tokens
    if tokenizer_type in ("HuggingFaceTokenizer", "PentatronBPETokenizer") and tokenizer_model:
        return HuggingFaceTokenizer(tokenizer_model, include_special, specials)
    if tokenizer_type == "PentatronBPETokenizer":
        from ..data.embedded_corpus import prepare_embedded_corpus

        corpus_dir = prepare_embedded_corpus(cache_dir=cache_dir).tokenizer_dir
        return HuggingFaceTokenizer(corpus_dir, include_special, specials)
    if tokenizer_type == "GPT2BPETokenizer":
        if not (vocab_file and merge_file):
            raise ValueError(
                flag_error(
                    "tokenizer-type",
                    tokenizer_type,
                    "needs --vocab-file and --merge-file",
                    "pass --vocab-file vocab.json --merge-file merges.txt",
                )
            )
        return _gpt2_bpe(vocab_file, merge_file, specials)
    if tokenizer_type in SENTENCEPIECE_TYPES:
        if specials:
            raise ValueError(
                flag_error(
                    "tokenizer-special-tokens",
                    " ".join(specials),
                    f"{tokenizer_type} takes its special tokens from the .model file "
                    "(Megatron's --tokenizer-sentencepiece-legacy wrapper is not supported)",
                    "train them into the model (sentencepiece user_defined_symbols) "
                    "and drop the flag",
                )
            )
        from .sentencepiece_tokenizer import SentencePieceTokenizer

        assert tokenizer_model is not None
        return SentencePieceTokenizer(tokenizer_model, name=tokenizer_type)
    if tokenizer_type == "TikTokenizer":
        from .tiktoken_tokenizer import TikTokenizer

        assert tokenizer_model is not None
        return TikTokenizer(
            tokenizer_model,
            pattern=tiktoken_pattern,
            vocab_size=vocab_size,
            num_special_tokens=tiktoken_num_special_tokens,
            special_tokens=special_tokens,
        )
    if tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    # NullTokenizer
    if vocab_size is None:
        raise ValueError(
            flag_error(
                "tokenizer-type",
                tokenizer_type,
                "needs --vocab-size (the model's vocabulary; the last id is end-of-document)",
                "pass --vocab-size N",
            )
        )
    return NullTokenizer(vocab_size, null_tokenizer_eod_id, null_tokenizer_pad_id)


def _gpt2_bpe(vocab_file: str, merge_file: str, special_tokens: Sequence[str] = ()) -> Tokenizer:
    """Megatron's GPT2BPETokenizer (HF's GPT2Tokenizer on these files): byte-level BPE,
    `<|endoftext|>` is the special eod token, no BOS added."""
    import os
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for src, flag, name in (
            (vocab_file, "vocab-file", "vocab.json"),
            (merge_file, "merge-file", "merges.txt"),
        ):
            if not os.path.isfile(src):
                raise FileNotFoundError(
                    flag_error(flag, src, "no such file", f"pass the GPT-2 {name} file")
                )
            shutil.copy(src, os.path.join(tmp, name))
        return HuggingFaceTokenizer(tmp, special_tokens=["<|endoftext|>", *special_tokens])
