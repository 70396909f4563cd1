"""Megatron's `TikTokenizer`: a tiktoken BPE from Megatron's JSON vocab file.

The file (`--tokenizer-model`, must end in `.json`) is a list of
`{"rank": i, "token_bytes": base64(bytes), "token_str": str}` with `rank == i` and the
first 256 entries the single bytes `0x00..0xff` in order. As in Megatron-LM (d98e8a64,
megatron/core/tokenizers/text/libraries/tiktoken_tokenizer.py):

- ids `0 .. num_special_tokens-1` are special tokens: the `--tokenizer-special-tokens`
  list (default `<unk> <s> </s> <mask> <pad> <cls> <sep>`, which any custom list must
  contain) then fillers `<SPECIAL_{i}>`;
- the file's rank `r` is id `r + num_special_tokens`, keeping only the first
  `vocab_size - num_special_tokens` entries, and the file must have that many;
- `vocab_size` = `--vocab-size`, default 2**17 = 131072 (not the file's length);
- `bos` = index of `<s>`, `eos` = `eod` = index of `</s>`, `pad` = index of `<pad>`,
  `unk` = index of `<unk>`;
- `tokenize(text)` = `encode(text, allowed_special="all")` (special-token text in the input
  becomes its id), `detokenize(ids)` = tiktoken's `decode`;
- `--tiktoken-pattern` v1 / v2 selects the pre-tokenization regex (default v2).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Sequence
from pathlib import Path

from .base import Tokenizer, as_int_list, flag_error

PATTERN_TIKTOKEN_V1 = (
    r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
PATTERN_TIKTOKEN_V2 = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TIKTOKEN_PATTERNS = {"v1": PATTERN_TIKTOKEN_V1, "v2": PATTERN_TIKTOKEN_V2}
DEFAULT_TIKTOKEN_VOCAB_SIZE = 2**17
DEFAULT_TIKTOKEN_NUM_SPECIAL_TOKENS = 1000
TIKTOKEN_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
SPECIAL_TOKEN_TEMPLATE = "<SPECIAL_{id}>"


def _bad_file(path: str, rule: str) -> ValueError:
    return ValueError(
        flag_error(
            "tokenizer-model",
            path,
            f"not a Megatron tiktoken vocab ({rule})",
            'pass the JSON list of {"rank", "token_bytes", "token_str"} written for TikTokenizer',
        )
    )


def load_tiktoken_ranks(path: str, max_vocab: int | None = None) -> dict[bytes, int]:
    """Megatron's JSON vocab file -> `{token bytes: rank}` (ranks `0..n-1`, unshifted), the
    first `max_vocab` entries."""
    if not path.endswith(".json"):
        raise _bad_file(path, "the file name must end in .json")
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad_file(path, f"cannot read it as JSON: {exc}") from None
    if not isinstance(vocab, list):
        raise _bad_file(path, f"the top level is a {type(vocab).__name__}, not a list")
    if max_vocab is not None:
        vocab = vocab[:max_vocab]
    ranks: dict[bytes, int] = {}
    for i, entry in enumerate(vocab):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"}:
            raise _bad_file(path, f"entry {i} is not a rank/token_bytes/token_str record")
        if entry["rank"] != i:
            raise _bad_file(path, f"entry {i} has rank {entry['rank']}")
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise _bad_file(path, f"entry {i}: token_bytes is not base64") from None
        if i < 256 and token != bytes([i]):
            raise _bad_file(path, f"entry {i} must be the single byte {i}, got {token!r}")
        if token in ranks:
            raise _bad_file(path, f"entry {i} repeats the bytes of rank {ranks[token]}")
        ranks[token] = i
    return ranks


class TikTokenizer(Tokenizer):
    """Megatron's TikTokenizer (module docstring)."""

    name = "TikTokenizer"

    def __init__(
        self,
        path: str | os.PathLike[str],
        pattern: str | None = "v2",
        vocab_size: int | None = None,
        num_special_tokens: int = DEFAULT_TIKTOKEN_NUM_SPECIAL_TOKENS,
        special_tokens: Sequence[str] | None = None,
    ):
        import tiktoken

        path = str(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                flag_error(
                    "tokenizer-model",
                    path,
                    "no such file (TikTokenizer reads Megatron's tiktoken JSON vocab)",
                    "pass the path of the tokenizer's .json vocab file",
                )
            )
        pattern = "v2" if pattern is None else pattern
        if pattern not in TIKTOKEN_PATTERNS:
            raise ValueError(
                flag_error(
                    "tiktoken-pattern",
                    pattern,
                    "TikTokenizer knows the regexes v1 and v2 only",
                    "pass --tiktoken-pattern v1 or v2 (the one the vocab was trained with)",
                )
            )
        size_flag = vocab_size
        vocab_size = vocab_size or DEFAULT_TIKTOKEN_VOCAB_SIZE
        specials = list(TIKTOKEN_SPECIAL_TOKENS if special_tokens is None else special_tokens)
        if len(set(specials)) != len(specials):
            raise ValueError(
                flag_error(
                    "tokenizer-special-tokens",
                    " ".join(specials),
                    "the special tokens repeat",
                    "list each special token once",
                )
            )
        missing = [t for t in TIKTOKEN_SPECIAL_TOKENS if t not in specials]
        if missing:
            raise ValueError(
                flag_error(
                    "tokenizer-special-tokens",
                    " ".join(specials),
                    f"TikTokenizer needs {' '.join(TIKTOKEN_SPECIAL_TOKENS)} among them, "
                    f"missing {' '.join(missing)}",
                    "add the missing tokens to the list (their positions give their ids)",
                )
            )
        if not len(specials) <= num_special_tokens < vocab_size:
            raise ValueError(
                flag_error(
                    "tiktoken-num-special-tokens",
                    num_special_tokens,
                    f"must be >= the {len(specials)} special tokens and < vocab_size {vocab_size}",
                    f"pass a count in [{len(specials)}, {vocab_size})",
                )
            )
        inner = vocab_size - num_special_tokens
        ranks = load_tiktoken_ranks(path, max_vocab=inner)
        if len(ranks) < inner:
            raise ValueError(
                flag_error(
                    "vocab-size",
                    size_flag if size_flag else f"None (default {DEFAULT_TIKTOKEN_VOCAB_SIZE})",
                    f"TikTokenizer's vocab_size counts {num_special_tokens} special ids plus "
                    f"{inner} file tokens, but {path} has {len(ranks)}",
                    f"pass --vocab-size {num_special_tokens + len(ranks)} (or fewer)",
                )
            )
        specials += [
            SPECIAL_TOKEN_TEMPLATE.format(id=i) for i in range(len(specials), num_special_tokens)
        ]
        self.special_tokens = specials
        self.special_token_ids = {t: i for i, t in enumerate(specials)}
        self.num_special_tokens = num_special_tokens
        self.pattern = pattern
        self.path = path
        self._vocab_size = vocab_size
        self._enc = tiktoken.Encoding(
            name=Path(path).parent.name,
            pat_str=TIKTOKEN_PATTERNS[pattern],
            mergeable_ranks={t: r + num_special_tokens for t, r in ranks.items()},
            special_tokens=self.special_token_ids,
        )

    @property
    def backend(self):
        """The underlying `tiktoken.Encoding` (special tokens 0..n-1, file ranks shifted by n)."""
        return self._enc

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self.special_token_ids["</s>"]

    @property
    def eos(self) -> int:
        return self.special_token_ids["</s>"]

    @property
    def bos(self) -> int:
        return self.special_token_ids["<s>"]

    @property
    def pad(self) -> int:
        return self.special_token_ids["<pad>"]

    @property
    def unk(self) -> int:
        return self.special_token_ids["<unk>"]

    def tokenize(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_batch(list(texts), allowed_special="all")

    def detokenize(self, ids) -> str:
        return self._enc.decode(as_int_list(ids))
