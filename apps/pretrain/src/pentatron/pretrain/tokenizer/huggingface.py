"""Hugging Face tokenizers through the `tokenizers` library (no `transformers` needed).

Accepts a `tokenizer.json` file, or a directory holding `tokenizer.json` (any HF tokenizer
directory saved by `save_pretrained`) or GPT-2 style `vocab.json` + `merges.txt`. The
end-of-document and pad tokens come from `tokenizer_config.json` / `special_tokens_map.json`
when present, else from the usual names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from .base import Tokenizer, as_int_list

EOD_CANDIDATES = (
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|eot_id|>",
    "<|im_end|>",
    "[SEP]",
)
PAD_CANDIDATES = ("<|pad|>", "<pad>", "[PAD]", "<|finetune_right_pad_id|>")


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "</s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read tokenizer file {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


class HuggingFaceTokenizer(Tokenizer):
    name = "HuggingFaceTokenizer"

    def __init__(
        self,
        path: str | os.PathLike[str],
        add_special_tokens: bool = True,
        special_tokens: Sequence[str] = (),
    ):
        """`add_special_tokens`: the post-processor's BOS/EOS on `tokenize` (Megatron's
        `--tokenizer-hf-no-include-special-tokens` turns it off). `special_tokens` (Megatron's
        `--tokenizer-special-tokens`): made special, appended as new ids when not in the vocab.
        """
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        config: dict = {}
        if path.is_dir():
            for name in ("special_tokens_map.json", "tokenizer_config.json"):
                if (path / name).is_file():
                    config.update(_read_json(path / name))
            if (path / "tokenizer.json").is_file():
                file = path / "tokenizer.json"
            elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
                file = None
            else:
                raise FileNotFoundError(
                    f"--tokenizer-model {path}: no tokenizer.json (or vocab.json + merges.txt) in that directory"
                )
        elif path.is_file():
            file = path
        else:
            raise FileNotFoundError(f"--tokenizer-model {path}: no such file or directory")
        try:
            if file is not None:
                self._tok = HFTokenizer.from_file(str(file))
            else:
                from tokenizers import decoders, models, pre_tokenizers

                bpe = models.BPE.from_file(str(path / "vocab.json"), str(path / "merges.txt"))
                self._tok = HFTokenizer(bpe)
                self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
                self._tok.decoder = decoders.ByteLevel()
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise ValueError(
                f"--tokenizer-model {path}: not a valid Hugging Face tokenizer ({exc})"
            ) from None
        if special_tokens:
            self._tok.add_special_tokens(list(special_tokens))
        self.path = str(path)
        self.add_special_tokens = add_special_tokens
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._bos = self._find(vocab, _token_text(config.get("bos_token")), ())
        eod = self._find(vocab, _token_text(config.get("eos_token")), EOD_CANDIDATES)
        if eod is None:
            raise ValueError(
                f"--tokenizer-model {path}: no end-of-document token (tried {', '.join(EOD_CANDIDATES)})"
            )
        self._eod = eod
        pad = self._find(vocab, _token_text(config.get("pad_token")), PAD_CANDIDATES)
        self._pad = self._eod if pad is None else pad

    @staticmethod
    def _find(vocab: dict, preferred: str | None, candidates) -> int | None:
        for token in ((preferred,) if preferred else ()) + tuple(candidates):
            if token in vocab:
                return int(vocab[token])
        return None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def bos(self) -> int | None:
        """The `bos_token` of tokenizer_config.json / special_tokens_map.json, if any."""
        return self._bos

    @property
    def backend(self):
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=self.add_special_tokens).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [
            e.ids for e in self._tok.encode_batch(texts, add_special_tokens=self.add_special_tokens)
        ]

    def detokenize(self, ids) -> str:
        return self._tok.decode(as_int_list(ids), skip_special_tokens=False)
