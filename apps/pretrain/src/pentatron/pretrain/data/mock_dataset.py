"""`MockGPTDataset`: a GPTDataset over synthetic documents, for runs and tests without data.

As Megatron's `MockGPTLowLevelDataset`: `size` documents whose lengths are drawn with
`numpy.random.default_rng(seed).integers(1, max_sequence_length)`; document i is
`1, 2, ..., length - 1` (wrapped to stay below `max_token`) followed by `eod`.
By default `size` is only as large as `num_samples` needs (about twice its tokens, at most
Megatron's 100,000 documents), so the one-epoch index stays small at short sequence lengths.
"""

from __future__ import annotations

import math

import numpy as np

from .gpt_dataset import GPTDataset, GPTDatasetConfig


class MockIndexedDataset:
    """The IndexedDataset read interface over generated documents (nothing on disk)."""

    def __init__(
        self,
        eod: int,
        size: int = 100_000,
        max_sequence_length: int = 4096,
        max_token: int = 4095,
        seed: int = 0,
    ):
        rng = np.random.default_rng(seed)
        self.sequence_lengths = rng.integers(1, max_sequence_length, size=size, dtype=np.int32)
        self.document_indices = np.arange(size + 1, dtype=np.int64)
        self.eod = eod
        self.max_token = max_token
        self.path_prefix = None

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int) -> np.ndarray:
        length = int(self.sequence_lengths[idx])
        body = np.arange(length - 1, dtype=np.int64) % self.max_token + 1
        return np.concatenate((body, np.array([self.eod], dtype=np.int64)))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        seq = self[idx]
        return seq[offset:] if length is None else seq[offset : offset + length]


class MockGPTDataset(GPTDataset):
    def __init__(
        self,
        num_samples: int | None,
        index_split: str,
        config: GPTDatasetConfig,
        size: int | None = None,
        max_sequence_length: int = 4096,
        max_token: int = 4095,
    ):
        if size is None:
            tokens = (num_samples or 10_000) * config.sequence_length + 1
            size = min(100_000, 64 + math.ceil(4 * tokens / max_sequence_length))
        low = MockIndexedDataset(config.eod, size, max_sequence_length, max_token, seed=0)
        super().__init__(low, None, np.arange(len(low)), num_samples, index_split, config)
