"""`BlendedDataset`: interleave datasets in fixed proportions, in Megatron's order.

Megatron's `build_blending_indices` (C++ helper): for sample i, pick the dataset whose
count lags most behind its share, `argmax_d(w_d * max(i, 1) - count_d)` (ties to the lowest
d), so after any prefix of n samples every dataset has within one sample of `w_d * n`.
No randomness: the order is a function of the weights and the size alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ._files import build_once, config_hash, load_npy, save_json, save_npy


def normalize_weights(weights) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(
            f"--data-path weights must be non-negative numbers with a positive sum, got {list(weights)}"
        )
    return w / w.sum()


def build_blending_indices(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16 `[size]`, dataset_sample_index int64 `[size]`)."""
    w = normalize_weights(weights).tolist()
    counts = [0] * len(w)
    chosen = [0] * size
    sample = [0] * size
    datasets = range(1, len(w))
    for i in range(size):
        x = max(float(i), 1.0)
        best, best_error = 0, w[0] * x - counts[0]
        for d in datasets:
            error = w[d] * x - counts[d]
            if error > best_error:  # strict: ties go to the lower dataset, as the C++ helper
                best, best_error = d, error
        chosen[i] = best
        sample[i] = counts[best]
        counts[best] += 1
    dataset_index = np.asarray(chosen, dtype=np.int16)
    dataset_sample_index = np.asarray(sample, dtype=np.int64)
    return dataset_index, dataset_sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """`size` samples drawn from `datasets` with proportions `weights`.

    Items are the member dataset's item plus `dataset_id`. `path_to_cache` (optional) stores
    the two index arrays as `.npy`, keyed by the md5 of the members' descriptions, weights
    and size; `group` builds them on its first rank.
    """

    def __init__(self, datasets, weights, size: int, path_to_cache: str | None = None, group=None):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.size = int(size)
        self.description = {
            "class": "BlendedDataset",
            "datasets": [getattr(d, "unique_hash", repr(d)) for d in self.datasets],
            "weights": [float(x) for x in self.weights],
            "size": self.size,
        }
        self.unique_hash = config_hash(self.description)
        if path_to_cache is None:
            self.dataset_index, self.dataset_sample_index = build_blending_indices(
                self.weights, self.size
            )
        else:
            stem = Path(path_to_cache) / f"{self.unique_hash}-BlendedDataset"
            files = {n: Path(f"{stem}-{n}.npy") for n in ("dataset_index", "dataset_sample_index")}
            desc = Path(f"{stem}-description.json")

            def build() -> None:
                a, b = build_blending_indices(self.weights, self.size)
                save_npy(files["dataset_index"], a)
                save_npy(files["dataset_sample_index"], b)
                save_json(desc, self.description)

            build_once(Path(f"{stem}.lock"), desc.is_file, build, group=group)
            self.dataset_index = load_npy(files["dataset_index"])
            self.dataset_sample_index = load_npy(files["dataset_sample_index"])
        for d, ds in enumerate(self.datasets):
            chosen = self.dataset_sample_index[self.dataset_index == d]
            if len(chosen) and int(chosen.max()) >= len(ds):
                raise ValueError(
                    f"blended dataset {d} has {len(ds)} samples but the blend needs {int(chosen.max()) + 1}"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blended dataset of {self.size}")
        d = int(self.dataset_index[idx])
        sample = self.datasets[d][int(self.dataset_sample_index[idx])]
        if isinstance(sample, dict):
            sample = dict(sample)
            sample["dataset_id"] = torch.tensor(d)
        return sample
