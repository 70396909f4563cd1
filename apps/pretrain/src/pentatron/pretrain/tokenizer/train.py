"""`pentatron-train-tokenizer`: train a byte-level BPE tokenizer with Hugging Face `tokenizers`.

    pentatron-train-tokenizer --input data.jsonl more.txt --json-keys text \\
        --vocab-size 32000 --output-dir my-tokenizer/

writes `my-tokenizer/tokenizer.json` (+ `tokenizer_config.json`, so `transformers`'
`AutoTokenizer` loads it too). Load it with `--tokenizer-type HuggingFaceTokenizer
--tokenizer-model my-tokenizer`. Special tokens: `<|endoftext|>` (id 0, end of document) and
`<|pad|>` (id 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..data._files import atomic_write
from .huggingface import HuggingFaceTokenizer

EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOD_TOKEN, PAD_TOKEN)


def train_bpe_tokenizer(
    texts: Iterable[str],
    output_dir: str | os.PathLike[str],
    vocab_size: int = 4096,
    min_frequency: int = 2,
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
    show_progress: bool = False,
) -> HuggingFaceTokenizer:
    """Train a byte-level BPE on `texts`, save it under `output_dir`, return it loaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(special_tokens):
        raise ValueError(
            f"--vocab-size must be at least {256 + len(special_tokens)} for byte-level BPE"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_write(out / "tokenizer.json", "w") as f:
        f.write(tokenizer.to_str())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": special_tokens[0],
        "bos_token": special_tokens[0],
        "unk_token": special_tokens[0],
        "pad_token": special_tokens[1] if len(special_tokens) > 1 else special_tokens[0],
        "model_max_length": 1 << 30,
    }
    with atomic_write(out / "tokenizer_config.json", "w") as f:
        json.dump(config, f, indent=2)
    return HuggingFaceTokenizer(out)


def iter_texts(paths: Iterable[str], json_keys: tuple[str, ...] = ("text",)) -> Iterator[str]:
    """Documents of each input: a `.jsonl` line's `json_keys` values, or a whole text file."""
    for name in paths:
        path = Path(name)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if file.suffix in (".jsonl", ".json"):
                with open(file, encoding="utf-8") as f:
                    for lineno, line in enumerate(f, 1):
                        if not line.strip():
                            continue
                        try:
                            record = json.loads(line)
                        except json.JSONDecodeError as exc:
                            raise ValueError(
                                f"--input {file}:{lineno}: not valid JSON ({exc.msg})"
                            ) from None
                        for key in json_keys:
                            if key not in record:
                                raise ValueError(
                                    f"--json-keys: key {key!r} missing in {file}:{lineno}"
                                )
                            yield str(record[key])
            else:
                yield file.read_text(encoding="utf-8", errors="replace")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pentatron-train-tokenizer", description=__doc__.split("\n")[0]
    )
    p.add_argument("--input", nargs="+", required=True, help="jsonl / text files or directories")
    p.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys to read from jsonl records"
    )
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--output-dir", required=True, help="directory for tokenizer.json")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in args.input:
        if not os.path.exists(name):
            print(f"error: --input {name}: no such file or directory", file=sys.stderr)
            return 2
    try:
        tok = train_bpe_tokenizer(
            iter_texts(args.input, tuple(args.json_keys)),
            args.output_dir,
            vocab_size=args.vocab_size,
            min_frequency=args.min_frequency,
            show_progress=not args.quiet,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {Path(args.output_dir) / 'tokenizer.json'}: vocab_size={tok.vocab_size} eod={tok.eod}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
