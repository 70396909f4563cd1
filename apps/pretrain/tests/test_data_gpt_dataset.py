"""GPTDataset: Megatron's indices, samples spanning documents, masks, on-disk cache."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pentatron.pretrain.data.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    build_indices,
    build_sample_index,
    get_ltor_masks_and_position_ids,
)
from pentatron.pretrain.data.indexed_dataset import IndexedDataset, build_from_documents
from pentatron.pretrain.data.mock_dataset import MockGPTDataset

EOD = 0


def reference_sample_index(sizes, doc_idx, seq_length, extra, drop_last=True):
    """Direct port of Megatron's C++ helpers.build_sample_idx."""
    total = int(sum(int(sizes[d]) for d in doc_idx))
    n = (total - extra) // seq_length if drop_last else -(-(total - extra) // seq_length)
    out = [(0, 0)]
    i, off = 0, 0
    while len(out) <= n:
        remaining = seq_length + extra
        while remaining != 0:
            length = int(sizes[doc_idx[i]]) - off
            remaining -= length
            if remaining <= 0:
                off += remaining + length - extra
                remaining = 0
            else:
                if i == len(doc_idx) - 1:
                    off = int(sizes[doc_idx[i]]) - extra
                    break
                i += 1
                off = 0
        out.append((i, off))
    return np.array(out)


@pytest.mark.parametrize("extra", [1, 0])
@pytest.mark.parametrize("seq_length", [1, 7, 64])
def test_sample_index_matches_megatron_loop(seq_length, extra):
    rng = np.random.default_rng(seq_length)
    sizes = rng.integers(0, 40, size=60).astype(np.int32)
    sizes[[0, 59]] = 5  # non-empty ends
    doc_idx = rng.permutation(np.tile(np.arange(60), 3)).astype(np.int32)
    doc_idx[0], doc_idx[-1] = 0, 59
    for drop_last in (True, False):
        got = build_sample_index(sizes, doc_idx, seq_length, extra, drop_last)
        assert np.array_equal(
            got, reference_sample_index(sizes, doc_idx, seq_length, extra, drop_last)
        )


def _docs(n=40, seed=0):
    rng = np.random.default_rng(seed)
    return [[*rng.integers(1, 500, size=rng.integers(1, 60)).tolist(), EOD] for _ in range(n)]


@pytest.fixture
def data(tmp_path):
    docs = _docs()
    build_from_documents(tmp_path / "d", docs, dtype=np.uint16)
    return tmp_path / "d", docs


def _config(tmp_path, **kw):
    kw.setdefault("path_to_cache", str(tmp_path / "cache"))
    return GPTDatasetConfig(random_seed=1234, sequence_length=16, eod=EOD, **kw)


def test_samples_are_windows_of_the_shuffled_stream(data, tmp_path):
    prefix, docs = data
    ds = GPTDataset(
        IndexedDataset(prefix), str(prefix), np.arange(40), 500, "train", _config(tmp_path)
    )
    assert len(ds) >= 500
    stream = np.concatenate([docs[d] for d in ds.document_index])  # independent of sample_index
    s = 16
    for idx in range(len(ds)):
        k = int(ds.shuffle_index[idx])
        sample = ds[idx]
        window = torch.from_numpy(stream[k * s : k * s + s + 1].astype(np.int64))
        assert torch.equal(sample["tokens"], window[:-1]) and torch.equal(
            sample["labels"], window[1:]
        )
        assert torch.equal(sample["loss_mask"], torch.ones(s)) and torch.equal(
            sample["position_ids"], torch.arange(s)
        )
    # epochs: every document appears equally often in document_index
    counts = np.bincount(ds.document_index, minlength=40)
    assert len(set(counts.tolist())) == 1 and counts[0] >= 2
    assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))


def test_separate_final_epoch():
    sizes = np.full(100, 11, dtype=np.int32)  # 1100 tokens/epoch, 110 samples/epoch at s=10
    doc, sample, shuffle = build_indices(sizes, np.arange(100), 120, 10, seed=3)
    assert len(doc) == 200 and sorted(doc[:100].tolist()) == list(
        range(100)
    )  # last epoch shuffled apart
    n_first = (1100 - 1) // 10
    assert sorted(shuffle[:n_first].tolist()) == list(range(n_first))
    doc, sample, shuffle = build_indices(
        sizes, np.arange(100), 215, 10, seed=3
    )  # 2nd epoch mostly used
    assert len(doc) == 200 and sorted(doc[:100].tolist()) != list(
        range(100)
    )  # both epochs shuffled together
    assert (
        sorted(shuffle.tolist()) == list(range(len(sample) - 1))
        and max(shuffle[:n_first]) >= n_first
    )


def test_deterministic_cached_and_loaded(data, tmp_path):
    prefix, _ = data
    low = IndexedDataset(prefix)
    a = GPTDataset(low, str(prefix), np.arange(30), 200, "train", _config(tmp_path))
    b = GPTDataset(low, str(prefix), np.arange(30), 200, "train", _config(tmp_path))
    assert a.built_by_this_process and not b.built_by_this_process
    assert isinstance(b.shuffle_index, np.memmap)
    fresh = GPTDataset(
        low,
        str(prefix),
        np.arange(30),
        200,
        "train",
        _config(tmp_path, path_to_cache=str(tmp_path / "c2")),
    )
    assert fresh.built_by_this_process
    for x, y in ((a, b), (a, fresh)):
        for name in ("document_index", "sample_index", "shuffle_index"):
            assert np.array_equal(getattr(x, name), getattr(y, name))
        assert all(torch.equal(x[i]["tokens"], y[i]["tokens"]) for i in range(len(x)))
    other_seed = GPTDataset(
        low,
        str(prefix),
        np.arange(30),
        200,
        "train",
        GPTDatasetConfig(
            random_seed=7, sequence_length=16, eod=EOD, path_to_cache=str(tmp_path / "cache")
        ),
    )
    assert other_seed.built_by_this_process and not np.array_equal(
        other_seed.shuffle_index, a.shuffle_index
    )
    files = sorted(p.name for p in (tmp_path / "cache").iterdir() if p.suffix in (".npy", ".json"))
    assert len(files) == 8 and all("-GPTDataset-train-" in f for f in files)


def test_corrupted_cache_is_a_clear_error(data, tmp_path):
    prefix, _ = data
    low = IndexedDataset(prefix)
    ds = GPTDataset(low, str(prefix), np.arange(30), 50, "train", _config(tmp_path))
    ds.cache_files()["sample_index"].write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"cannot read index cache file .*sample_index\.npy"):
        GPTDataset(low, str(prefix), np.arange(30), 50, "train", _config(tmp_path))


def test_masks_and_position_ids_closed_form():
    tokens = torch.tensor([5, 6, EOD, 7, 8, 9, EOD, 3])
    mask, loss, pos = get_ltor_masks_and_position_ids(tokens, EOD, True, True, True, True)
    assert pos.tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert loss.tolist() == [1, 1, 0, 1, 1, 1, 0, 1]
    doc = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])
    allowed = (doc[:, None] == doc[None, :]) & torch.tril(torch.ones(8, 8, dtype=torch.bool))
    assert torch.equal(mask[0], ~allowed)
    mask, loss, pos = get_ltor_masks_and_position_ids(tokens, EOD, False, False, False, True)
    assert torch.equal(mask[0], ~torch.tril(torch.ones(8, 8, dtype=torch.bool)))
    assert pos.tolist() == list(range(8)) and loss.tolist() == [1.0] * 8


def test_item_options_and_validation_padding(data, tmp_path):
    prefix, _ = data
    cfg = _config(tmp_path, eod_mask_loss=True, reset_position_ids=True, create_attention_mask=True)
    ds = GPTDataset(IndexedDataset(prefix), str(prefix), np.arange(40), 50, "train", cfg)
    item = ds[3]
    assert (
        item["attention_mask"].shape == (1, 16, 16) and item["attention_mask"].dtype == torch.bool
    )
    assert torch.equal(item["loss_mask"], (item["tokens"] != EOD).float())
    cfg = _config(tmp_path, drop_last_partial_validation_sequence=False, pad=999)
    valid = GPTDataset(IndexedDataset(prefix), str(prefix), np.arange(35, 40), None, "valid", cfg)
    last = valid.sample_index[-1]
    assert last[0] == len(valid.document_index) - 1  # the partial last sample is kept...
    k = int(np.nonzero(np.asarray(valid.shuffle_index) == len(valid) - 1)[0][0])
    item = valid[k]
    pad = item["labels"] == 999
    assert pad.any() and torch.equal(
        item["loss_mask"], (~pad).float()
    )  # ...and padded, its pads masked
    with pytest.raises(IndexError):
        valid[len(valid)]
    with pytest.raises(ValueError, match=r"split of .* has no documents"):
        GPTDataset(IndexedDataset(prefix), str(prefix), np.arange(0), 5, "test", cfg)


def test_mock_dataset():
    cfg = GPTDatasetConfig(random_seed=0, sequence_length=32, eod=4095)
    ds = MockGPTDataset(100, "train", cfg, size=500, max_sequence_length=64)
    assert len(ds) >= 100
    item = ds[0]
    assert item["tokens"].shape == (32,) and int(item["tokens"].max()) <= 4095
    again = MockGPTDataset(100, "train", cfg, size=500, max_sequence_length=64)
    assert torch.equal(again[7]["tokens"], ds[7]["tokens"])


def _build_on_ranks(prefix, cache):
    cfg = GPTDatasetConfig(random_seed=5, sequence_length=16, eod=EOD, path_to_cache=cache)
    ds = GPTDataset(
        IndexedDataset(prefix), prefix, np.arange(40), 300, "train", cfg, group=dist.group.WORLD
    )
    return (
        ds.built_by_this_process,
        np.asarray(ds.shuffle_index).tolist(),
        ds[11]["tokens"].tolist(),
    )


def test_one_rank_builds_the_others_load(distributed, data, tmp_path):
    prefix, _ = data
    results = distributed.run(2, _build_on_ranks, str(prefix), str(tmp_path / "shared"))
    assert [r[0] for r in results] == [True, False]
    assert results[0][1:] == results[1][1:]
    cfg = GPTDatasetConfig(
        random_seed=5, sequence_length=16, eod=EOD, path_to_cache=str(tmp_path / "shared")
    )
    local = GPTDataset(IndexedDataset(prefix), str(prefix), np.arange(40), 300, "train", cfg)
    assert not local.built_by_this_process and local[11]["tokens"].tolist() == results[0][2]
