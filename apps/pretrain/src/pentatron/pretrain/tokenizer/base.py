"""The interface every Pentatron tokenizer implements (Megatron's `MegatronTokenizer` subset)."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Tokenizer(ABC):
    """Text <-> token ids.

    `vocab_size` counts every id the tokenizer can emit (special tokens included); the model
    pads it further to a multiple of `make_vocab_size_divisible_by * tp`.
    """

    name: str = "tokenizer"

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def eod(self) -> int:
        """End-of-document id, appended after every document by preprocessing."""

    @property
    def pad(self) -> int:
        """Padding id (the end-of-document id unless the tokenizer has its own).

        Always a real row of the embedding: the dataset writes it into token positions (and
        masks them by position), so "no pad token" (Megatron's -1) falls back to `eod`.
        """
        return self.eod

    @property
    def bos(self) -> int | None:
        """Beginning-of-sequence id, or None when the tokenizer has none."""
        return None

    @property
    def eos(self) -> int:
        """End-of-sequence id (the end-of-document id unless the tokenizer has its own)."""
        return self.eod

    @abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abstractmethod
    def detokenize(self, ids) -> str: ...

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod}, pad={self.pad})"
        )


def flag_error(flag: str, value: object, rule: str, fix: str) -> str:
    """One line naming the flag, why and the fix (the format of `arguments_validate`)."""
    return f"--{flag}={value}: {rule}; fix: {fix}"


def as_int_list(ids) -> list[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]
