"""Megatron's pretraining batch samplers and the data loader built from them.

`MegatronPretrainingSampler` walks sample ids `consumed_samples, consumed_samples + 1, ...`
in global batches of `micro_batch_size * data_parallel_size`; data-parallel rank r takes the
r-th micro-batch of each. Resuming with the checkpoint's `consumed_samples` therefore yields
exactly the micro-batches the uninterrupted run would have seen next (shuffling lives in the
dataset's shuffle index, not in the sampler).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def _check(
    total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size
):
    if total_samples <= 0:
        raise ValueError(f"no samples to consume: total_samples={total_samples}")
    if micro_batch_size <= 0:
        raise ValueError(f"--micro-batch-size must be positive, got {micro_batch_size}")
    if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(
            f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})"
        )
    if consumed_samples < 0:
        raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")


class MegatronPretrainingSampler:
    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        _check(
            total_samples,
            consumed_samples,
            micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
        )
        if consumed_samples >= total_samples:
            raise ValueError(
                f"no samples left to consume: {consumed_samples} consumed of {total_samples}"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def _slice(self) -> tuple[int, int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return start, start + self.micro_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.micro_batch_times_data_parallel_size:
                a, b = self._slice()
                yield batch[a:b]
                batch = []
        if batch and not self.drop_last:
            a, b = self._slice()
            yield batch[a:b]


class MegatronPretrainingRandomSampler:
    """Megatron's `cyclic` sampler: each epoch a fresh permutation (seed + epoch) of this
    rank's bucket; resumes from `consumed_samples` within the epoch."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        seed: int = 0,
    ):
        _check(
            total_samples,
            consumed_samples,
            micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
        )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.micro_batch_times_data_parallel_size
        self.seed = seed

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        active_total = self.total_samples - self.last_batch_size
        epoch = self.consumed_samples // active_total
        current_epoch_samples = self.consumed_samples % active_total
        bucket_size = (
            self.total_samples // self.micro_batch_times_data_parallel_size
        ) * self.micro_batch_size
        bucket_offset = current_epoch_samples // self.data_parallel_size
        start_idx = self.data_parallel_rank * bucket_size
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        random_idx = torch.randperm(bucket_size, generator=g).tolist()
        idx_range = [start_idx + x for x in random_idx[bucket_offset:]]
        batch: list[int] = []
        for idx in idx_range:
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.micro_batch_times_data_parallel_size
                yield batch
                batch = []


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Stack each key of the sample dicts along a new batch dim 0."""
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def build_pretraining_data_loader(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    dataloader_type: str = "single",
    num_workers: int = 0,
    seed: int = 0,
    pin_memory: bool = False,
):
    """A torch DataLoader over `dataset` with Megatron's sampler (`single` or `cyclic`).

    `pin_memory`: page-locked batches (pass True when training on CUDA), so their copy to
    the GPU is asynchronous and overlaps the step."""
    if dataset is None:
        return None
    sampler: MegatronPretrainingSampler | MegatronPretrainingRandomSampler
    if dataloader_type == "single":
        sampler = MegatronPretrainingSampler(
            len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size
        )
    elif dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(
            len(dataset),
            consumed_samples,
            micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
            seed,
        )
    else:
        raise ValueError(f"--dataloader-type {dataloader_type!r}: choose 'single' or 'cyclic'")
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        # Its own generator: otherwise each new iterator draws from the global torch RNG,
        # and a run resumed from a checkpoint (RNG restored, then loaders built) would see
        # other dropout masks than the uninterrupted run.
        generator=torch.Generator().manual_seed(seed),
    )
