"""Tokenizers that need no files: bytes (the fallback) and Megatron's NullTokenizer."""

from __future__ import annotations

from .base import Tokenizer, as_int_list


class ByteLevelTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then `<|endoftext|>` = 256 (eod) and `<|pad|>` = 257."""

    name = "ByteLevelTokenizer"
    EOD = 256
    PAD = 257

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def eod(self) -> int:
        return self.EOD

    @property
    def pad(self) -> int:
        return self.PAD

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        data = bytes(i for i in as_int_list(ids) if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")


class NullTokenizer(Tokenizer):
    """Megatron's NullTokenizer: text is space-separated ids, eod = `vocab_size` argument."""

    name = "NullTokenizer"

    def __init__(self, vocab_size: int):
        if vocab_size < 1:
            raise ValueError(f"--vocab-size must be >= 1 for NullTokenizer, got {vocab_size}")
        self._without_eod = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._without_eod + 1

    @property
    def eod(self) -> int:
        return self._without_eod

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(i) for i in as_int_list(ids))
