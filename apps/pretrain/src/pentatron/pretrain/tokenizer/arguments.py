"""The tokenizer flags, Megatron-LM's names and defaults, shared by `pentatron-pretrain` and
`pentatron-preprocess-data` (as Megatron's tools/preprocess_data.py shares its trainer's),
and `tokenizer_from_args`, which builds the tokenizer they name."""

from __future__ import annotations

import argparse
from typing import Any

from .factory import build_tokenizer
from .tiktoken_tokenizer import DEFAULT_TIKTOKEN_NUM_SPECIAL_TOKENS


def add_tokenizer_file_args(g: Any) -> None:
    """Every tokenizer flag but `--tokenizer-type` (whose default each CLI sets)."""
    g.add_argument(
        "--tokenizer-model",
        default=None,
        help="HuggingFaceTokenizer: tokenizer.json or its folder; sentencepiece types: the "
        ".model file; TikTokenizer: the vocabulary .json",
    )
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer / mock data")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tiktoken-pattern", default=None, choices=["v1", "v2"], help="default v2")
    g.add_argument(
        "--tiktoken-num-special-tokens", type=int, default=DEFAULT_TIKTOKEN_NUM_SPECIAL_TOKENS
    )
    g.add_argument("--tokenizer-special-tokens", dest="special_tokens", nargs="+", default=None)
    g.add_argument("--null-tokenizer-eod-id", type=int, default=None)
    g.add_argument("--null-tokenizer-pad-id", type=int, default=-1)
    g.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_true")


def tokenizer_from_args(args: argparse.Namespace, cache_dir: str | None = None):
    """The tokenizer `args.tokenizer_type` names, from the flags above."""
    return build_tokenizer(
        args.tokenizer_type,
        args.tokenizer_model,
        args.vocab_size,
        args.vocab_file,
        args.merge_file,
        cache_dir=cache_dir,
        special_tokens=args.special_tokens,
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        null_tokenizer_eod_id=args.null_tokenizer_eod_id,
        null_tokenizer_pad_id=args.null_tokenizer_pad_id,
        tokenizer_hf_no_include_special_tokens=args.tokenizer_hf_no_include_special_tokens,
    )
