"""Blending in Megatron's order, --data-path / --split parsing, the three-split builder."""

import numpy as np
import pytest
import torch

from pentatron.pretrain.data.blended_dataset import BlendedDataset, build_blending_indices
from pentatron.pretrain.data.builder import (
    build_train_valid_test_datasets,
    parse_data_path,
    parse_split,
    split_indices,
)
from pentatron.pretrain.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from pentatron.pretrain.data.indexed_dataset import build_from_documents


def reference_blending(weights, size):
    """Port of Megatron's C++ build_blending_indices."""
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    current = [0] * len(w)
    out = []
    for i in range(size):
        x = max(float(i), 1.0)
        best, best_err = 0, w[0] * x - current[0]
        for d in range(1, len(w)):
            err = w[d] * x - current[d]
            if err > best_err:
                best, best_err = d, err
        out.append((best, current[best]))
        current[best] += 1
    return out


def test_blending_order_and_proportions():
    idx, sample = build_blending_indices([0.7, 0.3], 10_000)
    assert list(zip(idx.tolist()[:500], sample.tolist()[:500])) == reference_blending(
        [0.7, 0.3], 500
    )
    for n in (100, 1_000, 10_000):
        share = np.bincount(idx[:n], minlength=2) / n
        assert abs(share[0] - 0.7) < 0.01 and abs(share[1] - 0.3) < 0.01
    idx, _ = build_blending_indices([2, 1, 1], 10_000)
    assert np.allclose(np.bincount(idx) / 10_000, [0.5, 0.25, 0.25], atol=0.01)
    with pytest.raises(ValueError, match="non-negative"):
        build_blending_indices([1, -1], 10)


def test_parse_data_path_and_split():
    assert parse_data_path("0.7 a 0.3 b") == (["a", "b"], [0.7, 0.3])
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    for bad, msg in (
        ("0.7 a 0.3", "pairs"),
        ("a 0.3", "mixes"),
        ("0.5 a b c", "pairs"),
        ("", "empty"),
    ):
        with pytest.raises(ValueError, match=msg):
            parse_data_path(bad)
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    assert split_indices(parse_split("969,30,1"), 1000) == [0, 969, 999, 1000]
    assert split_indices(parse_split("1,1,1"), 10) == [
        0,
        4,
        7,
        10,
    ]  # Megatron moves the rounding gap
    with pytest.raises(ValueError, match="--split"):
        parse_split("0,0,0")


@pytest.fixture
def two_datasets(tmp_path):
    a = [[1] * 30 + [0] for _ in range(200)]  # dataset a is all 1s, b all 2s
    b = [[2] * 20 + [0] for _ in range(100)]
    build_from_documents(tmp_path / "a", a, np.uint16)
    build_from_documents(tmp_path / "b", b, np.uint16)
    return str(tmp_path / "a"), str(tmp_path / "b")


def test_blended_train_valid_test(two_datasets, tmp_path):
    a, b = two_datasets
    cfg = GPTDatasetConfig(
        random_seed=1, sequence_length=8, eod=0, path_to_cache=str(tmp_path / "cache")
    )
    train, valid, test = build_train_valid_test_datasets(
        f"0.7 {a} 0.3 {b}", "90,10,0", (10_000, 100, 5), cfg
    )
    assert (
        test is None
        and isinstance(train, BlendedDataset)
        and len(train) == 10_000
        and len(valid) == 100
    )
    ids = [int(train[i]["dataset_id"]) for i in range(10_000)]
    assert abs(np.mean(np.array(ids) == 0) - 0.7) < 0.01
    for i in range(0, 10_000, 97):  # the items really come from the named dataset
        item = train[i]
        assert set(item["tokens"].tolist()) <= {ids[i] + 1, 0}
    # train uses the first 90% of documents, valid the rest (train docs of a: 0..179)
    member = train.datasets[0]
    assert member.indices.tolist() == list(range(180)) and valid.datasets[
        0
    ].indices.tolist() == list(range(180, 200))
    again = build_train_valid_test_datasets(f"0.7 {a} 0.3 {b}", "90,10,0", (10_000, 100, 5), cfg)[0]
    assert np.array_equal(again.dataset_index, train.dataset_index)
    assert all(not m.built_by_this_process for m in again.datasets)
    assert torch.equal(again[1234]["tokens"], train[1234]["tokens"])


def test_single_dataset_and_errors(two_datasets, tmp_path):
    a, _ = two_datasets
    cfg = GPTDatasetConfig(
        random_seed=1, sequence_length=8, eod=0, path_to_cache=str(tmp_path / "cache")
    )
    train, _valid, test = build_train_valid_test_datasets([a], "90,5,5", (50, 10, 10), cfg)
    assert (
        isinstance(train, GPTDataset)
        and len(train) >= 50
        and test.indices.tolist() == list(range(190, 200))
    )
    # 200 docs: the test range rounds to none; the test set is then not evaluated
    assert build_train_valid_test_datasets([a], "969,30,1", (50, 10, 10), cfg)[2] is None
    # an empty validation range is an error: the run asked for evaluations
    with pytest.raises(ValueError, match=r"the valid split of .* has no documents; check --split"):
        build_train_valid_test_datasets([a], "995,1,4", (50, 10, 10), cfg)
    with pytest.raises(FileNotFoundError, match=r"--data-path .*missing"):
        build_train_valid_test_datasets([str(tmp_path / "missing")], "1", (5, 0, 0), cfg)
    mock = build_train_valid_test_datasets(None, "98,2,0", (20, 4, 4), cfg, mock=True)
    assert len(mock[0]) >= 20 and mock[2] is None
