"""Tokenizers for pentatron.pretrain: one interface, Megatron's types (Hugging Face, GPT-2 BPE,
sentencepiece, tiktoken, null), bytes, and our BPE."""

from .base import Tokenizer
from .byte_level import ByteLevelTokenizer, NullTokenizer
from .factory import TOKENIZER_TYPES, build_tokenizer
from .huggingface import HuggingFaceTokenizer
from .sentencepiece_tokenizer import SENTENCEPIECE_TYPES, SentencePieceTokenizer
from .tiktoken_tokenizer import TikTokenizer
from .train import EOD_TOKEN, PAD_TOKEN, train_bpe_tokenizer

__all__ = [
    "EOD_TOKEN",
    "PAD_TOKEN",
    "SENTENCEPIECE_TYPES",
    "TOKENIZER_TYPES",
    "ByteLevelTokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TikTokenizer",
    "Tokenizer",
    "build_tokenizer",
    "train_bpe_tokenizer",
]
