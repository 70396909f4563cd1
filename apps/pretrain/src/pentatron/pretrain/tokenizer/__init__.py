"""Tokenizers for pentatron.pretrain: one interface, Hugging Face files, bytes, and our BPE."""

from .base import Tokenizer
from .byte_level import ByteLevelTokenizer, NullTokenizer
from .factory import TOKENIZER_TYPES, build_tokenizer
from .huggingface import HuggingFaceTokenizer
from .train import EOD_TOKEN, PAD_TOKEN, train_bpe_tokenizer

__all__ = [
    "EOD_TOKEN",
    "PAD_TOKEN",
    "TOKENIZER_TYPES",
    "ByteLevelTokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "Tokenizer",
    "build_tokenizer",
    "train_bpe_tokenizer",
]
