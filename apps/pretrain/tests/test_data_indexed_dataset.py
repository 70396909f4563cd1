"""The .bin/.idx format: round trips, Megatron's exact bytes, and clear errors on corruption."""

import struct

import numpy as np
import pytest

from pentatron.pretrain.data.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    build_from_documents,
)


def _write(prefix, docs, dtype=np.int32):
    return build_from_documents(prefix, docs, dtype=dtype)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_round_trip_every_token(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 200, size=n).tolist() for n in (5, 0, 17, 1, 300)]
    ds = _write(tmp_path / "d", docs, dtype)
    assert len(ds) == 5 and ds.num_documents == 5 and ds.dtype == np.dtype(dtype)
    assert [ds[i].tolist() for i in range(5)] == docs
    assert ds.sequence_lengths.tolist() == [5, 0, 17, 1, 300]
    assert ds.document_indices.tolist() == [0, 1, 2, 3, 4, 5]
    assert ds.get(4, 10, 7).tolist() == docs[4][10:17]
    assert ds.get(2, 3).tolist() == docs[2][3:]
    assert [x.tolist() for x in ds[1:3]] == docs[1:3]
    assert ds[-1].tolist() == docs[-1]
    with pytest.raises(IndexError):
        ds[5]
    with pytest.raises(IndexError):
        ds.get(0, 3, 5)


def test_bytes_match_megatron_layout(tmp_path):
    """The .idx written field by field as Megatron's `_IndexWriter` does."""
    b = IndexedDatasetBuilder(tmp_path / "d.bin", dtype=np.uint16)
    b.add_item([1, 2, 3])
    b.add_item([4])
    b.end_document()
    b.add_item([5, 6])
    b.end_document()
    b.finalize(tmp_path / "d.idx")
    expected = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", 8)  # uint16
        + struct.pack("<Q", 3)
        + struct.pack("<Q", 3)
        + np.array([3, 1, 2], np.int32).tobytes()
        + np.array([0, 6, 8], np.int64).tobytes()
        + np.array([0, 2, 3], np.int64).tobytes()
    )
    assert (tmp_path / "d.idx").read_bytes() == expected
    assert (tmp_path / "d.bin").read_bytes() == np.array([1, 2, 3, 4, 5, 6], np.uint16).tobytes()
    ds = IndexedDataset(tmp_path / "d")
    assert ds.document_indices.tolist() == [0, 2, 3] and ds[1].tolist() == [4]
    assert [DType.code_from_dtype(t) for t in (np.uint8, np.int32, np.float32, np.uint16)] == [
        1,
        4,
        7,
        8,
    ]


def test_multimodal_modes_and_merge(tmp_path):
    b = IndexedDatasetBuilder(tmp_path / "m.bin", dtype=np.int32, multimodal=True)
    b.add_item([1, 2], mode=0)
    b.add_item([3], mode=1)
    b.end_document()
    b.finalize(tmp_path / "m.idx")
    ds = IndexedDataset(tmp_path / "m", multimodal=True)
    assert ds.sequence_modes.tolist() == [0, 1]
    with pytest.raises(ValueError, match="multimodal=True"):
        IndexedDataset(tmp_path / "m")

    _write(tmp_path / "a", [[1, 2], [3]])
    _write(tmp_path / "b", [[4, 5, 6]])
    merged = IndexedDatasetBuilder(tmp_path / "ab.bin", dtype=np.int32)
    merged.add_index(tmp_path / "a")
    merged.add_index(tmp_path / "b")
    merged.finalize(tmp_path / "ab.idx")
    ab = IndexedDataset(tmp_path / "ab")
    assert [x.tolist() for x in ab[0:3]] == [[1, 2], [3], [4, 5, 6]]
    assert ab.document_indices.tolist() == [0, 1, 2, 3]


def test_builder_is_atomic(tmp_path):
    b = IndexedDatasetBuilder(tmp_path / "x.bin")
    b.add_item([1, 2, 3])
    assert not (tmp_path / "x.bin").exists()  # only a temp file while building
    b.abort()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="outside the range of uint16"):
        IndexedDatasetBuilder(tmp_path / "y.bin", dtype=np.uint16).add_item([70000])


def _corrupt(path, how):
    data = bytearray(path.read_bytes())
    if how == "magic":
        data[0:4] = b"XXXX"
    elif how == "truncated":
        data = data[:-5]
    elif how == "header":
        data = data[:20]
    elif how == "version":
        data[9:17] = struct.pack("<Q", 7)
    elif how == "dtype":
        data[17] = 42
    elif how == "count":
        data[18:26] = struct.pack("<Q", 4)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "how, message",
    [
        ("magic", "bad magic"),
        ("truncated", "bytes, but 3 sequences"),
        ("header", "shorter than the 34-byte header"),
        ("version", "unsupported version 7"),
        ("dtype", "unknown dtype code 42"),
        ("count", "4 sequences"),
    ],
)
def test_corrupted_index_names_the_file(tmp_path, how, message):
    _write(tmp_path / "d", [[1, 2], [3], [4, 5]])
    _corrupt(tmp_path / "d.idx", how)
    with pytest.raises(ValueError) as info:
        IndexedDataset(tmp_path / "d")
    text = str(info.value)
    assert "\n" not in text and message in text and str(tmp_path / "d.idx") in text


def test_bin_size_mismatch_and_missing_files(tmp_path):
    _write(tmp_path / "d", [[1, 2], [3]])
    with open(tmp_path / "d.bin", "ab") as f:
        f.write(b"\x00\x00\x00\x00")
    with pytest.raises(
        ValueError, match=r"corrupted index file .*d\.idx.*12 bytes of int32.*16 bytes"
    ):
        IndexedDataset(tmp_path / "d")
    (tmp_path / "d.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"d\.bin"):
        IndexedDataset(tmp_path / "d")
    with pytest.raises(FileNotFoundError, match=r"nope\.idx"):
        IndexedDataset(tmp_path / "nope")


def test_pointer_mismatch_is_detected(tmp_path):
    _write(tmp_path / "d", [[1, 2], [3, 4, 5]])
    data = bytearray((tmp_path / "d.idx").read_bytes())
    off = 34 + 2 * 4 + 8  # second pointer
    data[off : off + 8] = struct.pack("<q", 4)
    (tmp_path / "d.idx").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="pointers do not match"):
        IndexedDataset(tmp_path / "d")
