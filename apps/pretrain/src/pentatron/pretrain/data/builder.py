"""Train / valid / test datasets from Megatron's `--data-path`, `--split` and sample counts.

- `--data-path a` or `--data-path 0.7 a 0.3 b` (weights normalised): `parse_data_path`.
- `--split 969,30,1`: `parse_split` normalises; `split_indices` cuts each dataset's sequences
  into contiguous train / valid / test ranges exactly as Megatron's `_get_split_indices`.
- `build_train_valid_test_datasets`: one GPTDataset per (dataset, split); with several
  datasets each is asked for `ceil(ceil(w * n) * 1.005)` samples and a BlendedDataset of n
  interleaves them. A split of weight 0 (or 0 samples) is None.
"""

from __future__ import annotations

import math
import os
import re

import numpy as np

from .blended_dataset import BlendedDataset, normalize_weights
from .gpt_dataset import GPTDataset, GPTDatasetConfig
from .indexed_dataset import IndexedDataset
from .mock_dataset import MockGPTDataset

SPLITS = ("train", "valid", "test")


def parse_data_path(data_path) -> tuple[list[str], list[float] | None]:
    """`["0.7", "a", "0.3", "b"]` -> (["a", "b"], [0.7, 0.3]); `["a", "b"]` -> (["a", "b"], None)."""
    if isinstance(data_path, str):
        data_path = data_path.split()
    items = [str(x) for x in data_path]
    if not items:
        raise ValueError("--data-path is empty")

    def is_number(x: str) -> bool:
        try:
            float(x)
        except ValueError:
            return False
        return True

    if len(items) == 1 or not is_number(items[0]):
        if any(is_number(x) for x in items):
            raise ValueError(
                f"--data-path mixes weights and paths: {' '.join(items)} (use 'w1 p1 w2 p2 ...')"
            )
        return items, None
    if len(items) % 2:
        raise ValueError(
            f"--data-path with weights needs pairs 'weight path', got {len(items)} items"
        )
    weights, paths = items[0::2], items[1::2]
    bad = [w for w in weights if not is_number(w)]
    if bad or any(is_number(p) for p in paths):
        raise ValueError(
            f"--data-path with weights needs pairs 'weight path', got {' '.join(items)}"
        )
    normalize_weights([float(w) for w in weights])
    return paths, [float(w) for w in weights]


def parse_split(split: str) -> list[float]:
    """`"969,30,1"` (or `"98/2/0"`) -> three fractions summing to 1."""
    values = [float(x) for x in re.findall(r"[.0-9]+", str(split))]
    if not values or len(values) > 3:
        raise ValueError(f"--split {split!r}: give up to three numbers, e.g. 969,30,1")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    if total <= 0:
        raise ValueError(f"--split {split!r}: the parts must have a positive sum")
    return [v / total for v in values]


def split_indices(fractions: list[float], num_elements: int) -> list[int]:
    """Boundaries [0, a, b, num_elements] of the train / valid / test ranges (Megatron's)."""
    bounds = [0]
    for f in fractions:
        bounds.append(bounds[-1] + round(f * float(num_elements)))
    diff = bounds[-1] - num_elements
    for i in range(1, len(bounds)):
        bounds[i] -= diff
    return bounds


def _open(prefix: str, mmap: bool) -> IndexedDataset:
    if not IndexedDataset.exists(prefix):
        raise FileNotFoundError(
            f"--data-path {prefix}: no {prefix}.bin / {prefix}.idx (pass the prefix, without extension)"
        )
    return IndexedDataset(prefix, mmap=mmap)


def build_train_valid_test_datasets(
    data_path,
    split: str,
    train_valid_test_num_samples: tuple[int | None, int | None, int | None],
    config: GPTDatasetConfig,
    group=None,
    mock: bool = False,
    mock_max_token: int = 4095,
) -> list:
    """[train, valid, test] datasets (each a GPTDataset, a BlendedDataset, or None).

    A split is None when its --split part or its sample count is 0. An empty document range
    is an error for train and valid (asked for by the run) and None for test: the test set
    is evaluated only when the split leaves it documents (`--split 969,30,1` of a small
    corpus rounds its range to nothing).

    `mock`: synthetic documents with ids in [1, mock_max_token] (see MockGPTDataset).
    """
    fractions = parse_split(split)
    if mock:
        return [
            None if not f or n == 0 else MockGPTDataset(n, name, config, max_token=mock_max_token)
            for f, n, name in zip(fractions, train_valid_test_num_samples, SPLITS)
        ]
    paths, weights = parse_data_path(data_path)
    opened = [_open(p, config.mmap_bin_files) for p in paths]
    per_dataset_bounds = [split_indices(fractions, len(ds)) for ds in opened]
    result: list[GPTDataset | BlendedDataset | None] = []
    for s, name in enumerate(SPLITS):
        n = train_valid_test_num_samples[s]
        empty_test = name == "test" and any(b[s] == b[s + 1] for b in per_dataset_bounds)
        if fractions[s] == 0 or n == 0 or empty_test:
            result.append(None)
            continue
        if len(paths) == 1:
            b = per_dataset_bounds[0]
            result.append(
                GPTDataset(opened[0], paths[0], np.arange(b[s], b[s + 1]), n, name, config, group)
            )
            continue
        w = normalize_weights(weights if weights is not None else [1.0] * len(paths))
        members = []
        for prefix, ds, b, wd in zip(paths, opened, per_dataset_bounds, w):
            need = None if n is None else math.ceil(math.ceil(n * wd) * 1.005)
            members.append(
                GPTDataset(ds, prefix, np.arange(b[s], b[s + 1]), need, name, config, group)
            )
        size = n if n is not None else sum(len(m) for m in members)
        cache = config.path_to_cache or os.path.join(
            os.path.dirname(os.path.abspath(paths[0])), "cache", "GPTDataset_indices"
        )
        result.append(BlendedDataset(members, w, size, path_to_cache=cache, group=group))
    return result
