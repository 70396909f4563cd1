"""Tokenizers that need no files: bytes (the fallback) and Megatron's NullTokenizer."""

from __future__ import annotations

from .base import Tokenizer, as_int_list, flag_error


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
    """Megatron's NullTokenizer (d98e8a64): text is space-separated ids, no files.

    `vocab_size` = `--vocab-size` exactly; `eod` = `--null-tokenizer-eod-id`, default
    `vocab_size - 1`; Megatron's pad is `--null-tokenizer-pad-id`, default -1 = none, and
    then Pentatron pads with `eod` (see `Tokenizer.pad`; `pad_id` keeps the raw value).
    (The removed legacy `_NullTokenizer` had `vocab_size + 1` ids with eod = `vocab_size`.)
    """

    name = "NullTokenizer"

    def __init__(self, vocab_size: int, eod_id: int | None = None, pad_id: int = -1):
        if vocab_size < 1:
            raise ValueError(
                flag_error(
                    "vocab-size",
                    vocab_size,
                    "NullTokenizer needs at least one id",
                    "pass the model's vocabulary size (its last id is the end-of-document id)",
                )
            )
        self._vocab_size = int(vocab_size)
        self._eod = self._vocab_size - 1 if eod_id is None else int(eod_id)
        if not 0 <= self._eod < self._vocab_size:
            raise ValueError(
                flag_error(
                    "null-tokenizer-eod-id",
                    eod_id,
                    f"must be an id in [0, {self._vocab_size}) (--vocab-size {self._vocab_size})",
                    "pass an id below --vocab-size, or drop the flag for vocab_size - 1",
                )
            )
        self.pad_id = int(pad_id)
        if self.pad_id >= self._vocab_size:
            raise ValueError(
                flag_error(
                    "null-tokenizer-pad-id",
                    pad_id,
                    f"must be below --vocab-size {self._vocab_size} (or -1 for none)",
                    "pass an id below --vocab-size, or -1",
                )
            )

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self.pad_id if self.pad_id >= 0 else self._eod

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(i) for i in as_int_list(ids))
