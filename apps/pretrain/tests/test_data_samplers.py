"""Megatron's pretraining samplers: resuming from consumed samples continues exactly."""

import numpy as np
import pytest
import torch

from pentatron.pretrain.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from pentatron.pretrain.data.indexed_dataset import IndexedDataset, build_from_documents
from pentatron.pretrain.data.samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)


def _steps(sampler_cls, total, consumed, mbs, dp, steps, **kw):
    """The micro-batches each dp rank sees for `steps` global steps of one micro-batch each."""
    its = [iter(sampler_cls(total, consumed, mbs, r, dp, **kw)) for r in range(dp)]
    return [[next(it) for it in its] for _ in range(steps)]


@pytest.mark.parametrize("cls", [MegatronPretrainingSampler, MegatronPretrainingRandomSampler])
def test_resume_from_consumed_samples_is_exact(cls):
    mbs, dp, total = 3, 2, 200
    full = _steps(cls, total, 0, mbs, dp, 20)
    seen = sorted(i for step in full for batch in step for i in batch)
    assert len(seen) == len(set(seen)) == 20 * mbs * dp  # no sample twice within the epoch
    for stop in (1, 7, 13):
        resumed = _steps(cls, total, stop * mbs * dp, mbs, dp, 20 - stop)
        assert resumed == full[stop:]


def test_single_sampler_layout_and_errors():
    batches = list(MegatronPretrainingSampler(10, 0, 2, 1, 2))
    assert batches == [[2, 3], [6, 7]]  # rank 1 takes the 2nd micro-batch of each global batch
    assert list(MegatronPretrainingSampler(10, 0, 2, 1, 2, drop_last=False)) == [[2, 3], [6, 7], []]
    assert list(MegatronPretrainingSampler(10, 0, 2, 0, 2, drop_last=False)) == [
        [0, 1],
        [4, 5],
        [8, 9],
    ]
    with pytest.raises(ValueError, match="no samples left"):
        MegatronPretrainingSampler(10, 10, 2, 0, 2)
    with pytest.raises(ValueError, match="data_parallel_rank 2"):
        MegatronPretrainingSampler(10, 0, 2, 2, 2)
    with pytest.raises(ValueError, match="--micro-batch-size"):
        MegatronPretrainingSampler(10, 0, 0, 0, 2)


def test_data_loader_resume_gives_the_same_batches(tmp_path):
    rng = np.random.default_rng(0)
    docs = [[*rng.integers(1, 100, size=rng.integers(5, 40)).tolist(), 0] for _ in range(50)]
    build_from_documents(tmp_path / "d", docs, np.uint16)
    cfg = GPTDatasetConfig(
        random_seed=9, sequence_length=12, eod=0, path_to_cache=str(tmp_path / "c")
    )
    ds = GPTDataset(
        IndexedDataset(tmp_path / "d"), str(tmp_path / "d"), np.arange(50), 120, "train", cfg
    )
    mbs, dp = 2, 2

    def run(consumed, steps):
        loaders = [iter(build_pretraining_data_loader(ds, consumed, mbs, r, dp)) for r in range(dp)]
        return [[next(it)["tokens"] for it in loaders] for _ in range(steps)]

    full = run(0, 10)
    assert full[0][0].shape == (mbs, 12)
    resumed = run(6 * mbs * dp, 4)
    assert all(torch.equal(x, y) for a, b in zip(full[6:], resumed) for x, y in zip(a, b))
    assert not torch.equal(full[0][0], full[0][1])  # dp ranks see different data
