"""Megatron's sentencepiece tokenizers: `GPTSentencePieceTokenizer`, `Llama2Tokenizer`,
`SentencePieceTokenizer`, all from one `--tokenizer-model` `.model` file.

Megatron-LM (d98e8a64, megatron/core/tokenizers/text/libraries/sentencepiece_tokenizer.py)
builds the same tokenizer for all three names (`legacy=False`,
`ignore_extra_whitespaces=True`):

- `vocab_size` = `sp.get_piece_size()` (no ids added);
- `tokenize(text)` = `sp.encode_as_ids(text)`: no BOS/EOS added (the removed legacy
  `_Llama2Tokenizer` prepended BOS; current Megatron does not);
- `detokenize(ids)` = `sp.decode_ids(ids)`;
- `bos` = `sp.bos_id()`, `eos` = `eod` = `sp.eos_id()`, `pad` = `sp.pad_id()`,
  `unk` = `sp.unk_id()`.

One difference: a model without a pad piece has `sp.pad_id() == -1`; Megatron reports -1,
Pentatron's `pad` falls back to `eod` (see `Tokenizer.pad`); `pad_id` keeps the raw value.
"""

from __future__ import annotations

import os
from pathlib import Path

from .base import Tokenizer, as_int_list, flag_error

SENTENCEPIECE_TYPES = ("GPTSentencePieceTokenizer", "Llama2Tokenizer", "SentencePieceTokenizer")


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece `.model` file with Megatron's id conventions (module docstring)."""

    def __init__(self, model_file: str | os.PathLike[str], name: str = "GPTSentencePieceTokenizer"):
        import sentencepiece

        path = Path(model_file)
        if not path.is_file():
            raise FileNotFoundError(
                flag_error(
                    "tokenizer-model",
                    model_file,
                    f"no such file ({name} reads a sentencepiece .model file)",
                    "pass the path of the tokenizer.model file",
                )
            )
        sp = sentencepiece.SentencePieceProcessor()
        try:
            sp.Load(str(path))
        except (RuntimeError, OSError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(
                flag_error(
                    "tokenizer-model",
                    model_file,
                    f"not a sentencepiece model ({reason})",
                    "pass a .model file written by sentencepiece training "
                    "(a tokenizer.json needs --tokenizer-type HuggingFaceTokenizer)",
                )
            ) from None
        if sp.eos_id() < 0:
            raise ValueError(
                flag_error(
                    "tokenizer-model",
                    model_file,
                    f"the model has no end-of-sentence piece, which {name} uses as end-of-document",
                    "train the model with an eos piece (sentencepiece's eos_id >= 0)",
                )
            )
        self.name = name
        self.path = str(path)
        self._sp = sp

    @property
    def backend(self):
        """The underlying `sentencepiece.SentencePieceProcessor`."""
        return self._sp

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def eod(self) -> int:
        return int(self._sp.eos_id())

    @property
    def eos(self) -> int:
        return int(self._sp.eos_id())

    @property
    def bos(self) -> int | None:
        bos = int(self._sp.bos_id())
        return bos if bos >= 0 else None

    @property
    def pad_id(self) -> int:
        """The model's own pad id, -1 when it has none (Megatron's `pad`)."""
        return int(self._sp.pad_id())

    @property
    def pad(self) -> int:
        return self.pad_id if self.pad_id >= 0 else self.eod

    @property
    def unk(self) -> int:
        return int(self._sp.unk_id())

    def tokenize(self, text: str) -> list[int]:
        return list(self._sp.encode_as_ids(text))

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self._sp.encode_as_ids(list(texts))]

    def detokenize(self, ids) -> str:
        return self._sp.decode_ids(as_int_list(ids))
