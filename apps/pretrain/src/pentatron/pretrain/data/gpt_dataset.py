"""`GPTDataset`: fixed-length samples cut from the token stream of a shuffled document order.

Megatron's construction (megatron/core/datasets/gpt_dataset.py), step by step:

1. `document_index`: the split's sequence ids repeated for as many epochs as `num_samples`
   needs, shuffled with `numpy.random.RandomState(seed)`. When the last epoch would be used
   for less than 80% of its samples it is shuffled separately (`separate_final_epoch`), so
   its partial use stays a random subset.
2. `sample_index` `[n + 1, 2]`: sample k starts at `(document_index position, offset)`
   `sample_index[k]` and ends (inclusively, the extra label token) at `sample_index[k + 1]`;
   every sample holds `seq_length + 1` tokens and spans documents.
3. `shuffle_index`: a permutation of the samples (the same RandomState, continued).

The three arrays are built once and cached as `.npy` under `path_to_cache`, named by the md5
of a JSON description of everything they depend on; with a process group, its first rank
builds while the others wait at a barrier and then load (mmap).

An item is a dict of tensors: `tokens` and `labels` `[s]` int64, `loss_mask` `[s]` float32,
`position_ids` `[s]` int64 and, with `create_attention_mask`, `attention_mask` `[1, s, s]`
bool (True = masked out, Megatron's convention).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ._files import build_once, config_hash, load_npy, save_json, save_npy

logger = logging.getLogger(__name__)

INDEX_VERSION = 1
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


class TokenDocuments(Protocol):
    """The read interface of the token sequences a `GPTDataset` cuts samples from
    (`IndexedDataset`'s; `MockIndexedDataset` generates them)."""

    @property
    def sequence_lengths(self) -> np.ndarray: ...

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray: ...


@dataclass
class GPTDatasetConfig:
    """What a GPTDataset needs beyond its data (Megatron's `GPTDatasetConfig` fields)."""

    random_seed: int
    sequence_length: int
    eod: int
    pad: int | None = None
    path_to_cache: str | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = False
    mmap_bin_files: bool = True  # False: each .bin is read into memory (--no-mmap-bin-files)
    add_extra_token_to_sequence: bool = True
    drop_last_partial_validation_sequence: bool = True

    def __post_init__(self) -> None:
        if self.sequence_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {self.sequence_length}")
        if self.reset_attention_mask and not self.create_attention_mask:
            raise ValueError(
                "--reset-attention-mask needs the attention mask (create_attention_mask=True)"
            )
        if self.pad is None:
            self.pad = self.eod


# ---------------------------------------------------------------------------------------
# Index construction (pure functions of numpy arrays, tested against a direct port of
# Megatron's C++ `build_sample_idx`).


def num_epochs_for(
    num_tokens_per_epoch: int, num_samples: int | None, seq_length: int, extra: int
) -> int:
    if num_tokens_per_epoch <= extra:
        raise ValueError(
            f"a split of {num_tokens_per_epoch} tokens cannot hold one sample of {seq_length}"
        )
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + extra
    return max(1, math.ceil(needed / num_tokens_per_epoch))


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(
    sequence_lengths: np.ndarray,
    document_index: np.ndarray,
    seq_length: int,
    extra: int,
    drop_last_partial: bool = True,
) -> np.ndarray:
    """`[n + 1, 2]` int64 (position in document_index, token offset) of each sample boundary."""
    lengths = np.asarray(sequence_lengths, dtype=np.int64)[document_index]
    cum = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cum[1:])
    total = int(cum[-1])
    if drop_last_partial:
        n = (total - extra) // seq_length
    else:
        n = math.ceil((total - extra) / seq_length)
    p = np.arange(n + 1, dtype=np.int64) * seq_length
    if extra:
        doc = np.searchsorted(cum, p, side="right") - 1
    else:
        doc = np.searchsorted(cum[1:], p, side="left")
    inside = p <= total - extra if extra else p <= total
    doc = np.where(inside, doc, len(lengths) - 1)
    doc = np.minimum(doc, len(lengths) - 1)
    offset = np.where(inside, p - cum[doc], lengths[-1] - extra)
    out = np.stack((doc, offset), axis=1)
    out[0] = 0
    return out


def build_shuffle_index(
    num_samples: int, total_size: int, rng: np.random.RandomState
) -> np.ndarray:
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_indices(
    sequence_lengths, documents, num_samples, seq_length, seed, extra=1, drop_last_partial=True
):
    """(document_index, sample_index, shuffle_index) exactly as Megatron's GPTDataset builds them."""
    documents = np.asarray(documents)
    tokens_per_epoch = int(np.asarray(sequence_lengths, dtype=np.int64)[documents].sum())
    num_epochs = num_epochs_for(tokens_per_epoch, num_samples, seq_length, extra)
    if num_epochs == 1:
        separate = False
    else:
        sans_final = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
        from_final = num_samples - sans_final
        per_epoch = (tokens_per_epoch - extra) // seq_length
        separate = from_final < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate)
    sample_index = build_sample_index(
        sequence_lengths, document_index, seq_length, extra, drop_last_partial
    )
    n = sans_final if separate else len(sample_index) - 1
    shuffle_index = build_shuffle_index(n, len(sample_index) - 1, rng)
    return document_index, sample_index, shuffle_index


# ---------------------------------------------------------------------------------------
# Masks and position ids.


def get_ltor_masks_and_position_ids(
    tokens: torch.Tensor,
    eod: int,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = True,
):
    """Megatron's left-to-right masks for a 1-D `tokens` `[s]`.

    Returns (attention_mask `[1, s, s]` bool with True = masked, or None; loss_mask `[s]`
    float32, 0 where the input token is eod if eod_mask_loss; position_ids `[s]` int64,
    restarting after each eod if reset_position_ids).
    """
    s = tokens.numel()
    attention_mask = None
    if create_attention_mask:
        attention_mask = torch.tril(torch.ones((s, s), dtype=torch.bool)).unsqueeze(0)
    loss_mask = torch.ones(s, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    position_ids = torch.arange(s, dtype=torch.long)
    if reset_position_ids or reset_attention_mask:
        position_ids = position_ids.clone()
        prev = 0
        for i in torch.nonzero(tokens == eod).flatten().tolist():
            if reset_attention_mask and attention_mask is not None:
                attention_mask[0, i + 1 :, : i + 1] = False
            if reset_position_ids:
                position_ids[i + 1 :] -= i + 1 - prev
                prev = i + 1
    if attention_mask is not None:
        attention_mask = ~attention_mask
    return attention_mask, loss_mask, position_ids


# ---------------------------------------------------------------------------------------


class GPTDataset(torch.utils.data.Dataset):
    """Samples of `sequence_length + 1` tokens from `indexed_dataset` restricted to `indices`.

    `dataset_path` names the data (for the cache key and default cache folder; None keeps the
    indices in memory only). `num_samples` None means one epoch. `group`: the torch.distributed
    group whose first rank builds the cache.
    """

    def __init__(
        self,
        indexed_dataset: TokenDocuments,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: str,
        config: GPTDatasetConfig,
        group=None,
    ):
        self.dataset = indexed_dataset
        self.dataset_path = dataset_path
        self.indices = np.asarray(indices, dtype=np.int64)
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config
        if len(self.indices) == 0:
            raise ValueError(
                f"the {index_split} split of {dataset_path} has no documents; check --split"
            )
        self.extra = int(config.add_extra_token_to_sequence)
        self.drop_last_partial = (
            index_split != "valid" or config.drop_last_partial_validation_sequence
        )
        self.description = self._description()
        self.unique_hash = config_hash(self.description)
        self.built_by_this_process = False
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build(group)

    def _description(self) -> dict:
        lengths = np.ascontiguousarray(self.dataset.sequence_lengths)
        return {
            "class": "GPTDataset",
            "index_version": INDEX_VERSION,
            "dataset_path": None
            if self.dataset_path is None
            else os.path.abspath(self.dataset_path),
            "sequence_lengths_md5": hashlib.md5(lengths.tobytes()).hexdigest(),
            "indices_md5": hashlib.md5(self.indices.tobytes()).hexdigest(),
            "num_samples": self.num_samples,
            "index_split": self.index_split,
            "random_seed": self.config.random_seed,
            "sequence_length": self.config.sequence_length,
            "add_extra_token_to_sequence": self.extra,
            "drop_last_partial": self.drop_last_partial,
        }

    def _build(self):
        start = time.perf_counter()
        arrays = build_indices(
            self.dataset.sequence_lengths,
            self.indices,
            self.num_samples,
            self.config.sequence_length,
            self.config.random_seed,
            self.extra,
            self.drop_last_partial,
        )
        self.built_by_this_process = True
        logger.info(
            "built %s indices for %s (%s) in %.2f s",
            self.index_split,
            self.dataset_path,
            self.unique_hash,
            time.perf_counter() - start,
        )
        return arrays

    def cache_files(self) -> dict[str, Path] | None:
        if self.dataset_path is None:
            return None
        folder = self.config.path_to_cache
        if folder is None:
            folder = os.path.join(
                os.path.dirname(os.path.abspath(self.dataset_path)), "cache", "GPTDataset_indices"
            )
        stem = f"{self.unique_hash}-GPTDataset-{self.index_split}"
        names = ("description", "document_index", "sample_index", "shuffle_index")
        return {
            n: Path(folder) / f"{stem}-{n}.{'json' if n == 'description' else 'npy'}" for n in names
        }

    def _load_or_build(self, group):
        files = self.cache_files()
        if files is None:
            return self._build()

        def is_built() -> bool:  # the description is written last
            return files["description"].is_file()

        def build() -> None:
            arrays = self._build()
            for name, array in zip(("document_index", "sample_index", "shuffle_index"), arrays):
                save_npy(files[name], array)
            save_json(files["description"], self.description)

        build_once(files["description"].with_suffix(".lock"), is_built, build, group=group)
        arrays = tuple(
            load_npy(files[n]) for n in ("document_index", "sample_index", "shuffle_index")
        )
        document_index, sample_index, shuffle_index = arrays
        if (
            sample_index.ndim != 2
            or sample_index.shape[1] != 2
            or len(shuffle_index) != len(sample_index) - 1
        ):
            raise ValueError(
                f"index cache {files['sample_index']} does not match its description; delete it"
            )
        return document_index, sample_index, shuffle_index

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def get_text(self, idx: int) -> np.ndarray:
        """The `sequence_length + extra` raw token ids of sample `idx` (after shuffling), padded."""
        if not 0 <= idx < len(self):
            raise IndexError(
                f"sample {idx} out of range for a {self.index_split} dataset of {len(self)}"
            )
        k = int(self.shuffle_index[idx])
        beg, beg_off = (int(v) for v in self.sample_index[k])
        end, end_off = (int(v) for v in self.sample_index[k + 1])
        doc = self.document_index
        if beg == end:
            parts = [self.dataset.get(int(doc[beg]), beg_off, end_off - beg_off + self.extra)]
        else:
            parts = [self.dataset.get(int(doc[beg]), beg_off)]
            parts += [self.dataset.get(int(doc[i])) for i in range(beg + 1, end)]
            parts.append(self.dataset.get(int(doc[end]), 0, end_off + self.extra))
        text = np.concatenate(parts).astype(np.int64)
        return text

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        text = self.get_text(int(idx))
        return make_sample(text, self.config, self.extra)


def make_sample(
    text: np.ndarray, config: GPTDatasetConfig, extra: int = 1
) -> dict[str, torch.Tensor]:
    """tokens / labels / loss_mask / position_ids (/ attention_mask) from raw ids `text`."""
    want = config.sequence_length + extra
    n_pad = want - len(text)
    if n_pad > 0:
        text = np.concatenate((text, np.full(n_pad, config.pad, dtype=np.int64)))
    ids = torch.from_numpy(np.ascontiguousarray(text, dtype=np.int64))
    if extra:
        tokens, labels = ids[:-1].contiguous(), ids[1:].contiguous()
    else:
        tokens, labels = ids, torch.roll(ids, shifts=-1)
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens,
        config.eod,
        config.reset_position_ids,
        config.reset_attention_mask,
        config.eod_mask_loss,
        config.create_attention_mask,
    )
    if n_pad > 0:  # mask the padded label positions (by position, so pad == eod is safe)
        loss_mask[len(labels) - n_pad :] = 0.0
    if not extra:
        loss_mask[-1] = 0.0
    sample = {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
    }
    if attention_mask is not None:
        sample["attention_mask"] = attention_mask
    return sample


def config_dict(config: GPTDatasetConfig) -> dict:
    return asdict(config)
