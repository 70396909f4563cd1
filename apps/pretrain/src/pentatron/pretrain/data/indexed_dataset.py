"""Megatron's indexed dataset: a `.bin` token stream and its `.idx` index, read through mmap.

Byte-compatible with Megatron-LM's `IndexedDataset` / `MMapIndexedDataset` (version 1):

    .idx  = b"MMIDIDX\\x00\\x00"                 9 bytes, magic
            version                            <Q   (1)
            dtype code                         <B   (DType below)
            sequence count S                   <Q
            document count D                   <Q   (number of documents + 1)
            sequence_lengths                   int32[S]  elements per sequence
            sequence_pointers                  int64[S]  byte offset of each sequence in .bin
            document_indices                   int64[D]  [0, end of doc 0, end of doc 1, ...]
            sequence_modes (multimodal only)   int8[S]
    .bin  = every sequence's elements back to back, in the dtype of the code

A document is a run of sequences `document_indices[i]:document_indices[i+1]`; the GPT pipeline
writes one sequence per document.
"""

from __future__ import annotations

import os
import struct
from enum import IntEnum
from pathlib import Path

import numpy as np

from ._files import atomic_write

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_VERSION = 1
_FIXED = len(_INDEX_HEADER) + 8 + 1 + 8 + 8  # bytes before the arrays


class DType(IntEnum):
    """The dtype codes of Megatron's `.idx` header."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, dtype) -> int:
        return int(cls[np.dtype(dtype).name])

    @classmethod
    def dtype_from_code(cls, code: int) -> type:
        return getattr(np, cls(code).name)

    @staticmethod
    def optimal_dtype(vocab_size: int | None) -> type:
        """uint16 for vocabularies below 65500 tokens (as Megatron), else int32."""
        return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file_path(path_prefix: str | os.PathLike[str]) -> str:
    return str(path_prefix) + ".bin"


def index_file_path(path_prefix: str | os.PathLike[str]) -> str:
    return str(path_prefix) + ".idx"


class IndexedDatasetBuilder:
    """Write a `.bin` / `.idx` pair.

        builder = IndexedDatasetBuilder("out.bin", dtype=np.uint16)
        builder.add_item(tokens)        # one sequence (list, ndarray or 1-D tensor)
        builder.end_document()          # the sequences added so far form a document
        builder.finalize("out.idx")

    Both files are written to temp names and renamed into place by `finalize`.
    """

    def __init__(self, bin_path: str | os.PathLike[str], dtype=np.int32, multimodal: bool = False):
        self.bin_path = str(bin_path)
        self.dtype = np.dtype(dtype)
        DType.code_from_dtype(self.dtype)  # validates
        self.multimodal = multimodal
        self._bin_ctx = atomic_write(self.bin_path, "wb")
        self._bin = self._bin_ctx.__enter__()
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]
        self.sequence_modes: list[int] = []
        self._finalized = False

    def add_item(self, tokens, mode: int = 0) -> None:
        if hasattr(tokens, "numpy"):
            tokens = tokens.detach().cpu().numpy()
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"add_item expects a 1-D sequence, got shape {array.shape}")
        if (
            array.size
            and np.issubdtype(array.dtype, np.integer)
            and np.issubdtype(self.dtype, np.integer)
        ):
            info = np.iinfo(self.dtype)
            if array.min() < info.min or array.max() > info.max:
                raise ValueError(
                    f"token ids outside the range of {self.dtype.name} in {self.bin_path}"
                )
        self._bin.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self.sequence_lengths.append(int(array.size))
        if self.multimodal:
            self.sequence_modes.append(int(mode))

    def add_document(self, tokens, lengths, modes=None) -> None:
        """Add a document made of `len(lengths)` consecutive sequences of `tokens`."""
        array = np.asarray(tokens)
        start = 0
        for i, n in enumerate(lengths):
            self.add_item(array[start : start + n], 0 if modes is None else modes[i])
            start += n
        self.end_document()

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str | os.PathLike[str]) -> None:
        """Append every document of an existing dataset (same dtype) to this one."""
        other = IndexedDataset(path_prefix, mmap=False)
        if other.dtype != self.dtype:
            raise ValueError(
                f"{index_file_path(path_prefix)} holds {other.dtype}, builder writes {self.dtype}"
            )
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(int(n) for n in other.sequence_lengths)
        self.document_indices.extend(int(i) + offset for i in other.document_indices[1:])
        if self.multimodal:
            modes = (
                other.sequence_modes
                if other.sequence_modes is not None
                else np.zeros(len(other), np.int8)
            )
            self.sequence_modes.extend(int(m) for m in modes)
        with open(data_file_path(path_prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._bin.write(chunk)

    def finalize(self, idx_path: str | os.PathLike[str]) -> None:
        if self._finalized:
            raise RuntimeError("IndexedDatasetBuilder.finalize called twice")
        self._finalized = True
        self._bin_ctx.__exit__(None, None, None)
        write_index(
            idx_path,
            self.dtype,
            self.sequence_lengths,
            self.document_indices,
            self.sequence_modes if self.multimodal else None,
        )

    def abort(self) -> None:
        """Drop the partial `.bin` (nothing is left at its final path)."""
        if not self._finalized:
            self._finalized = True
            error = RuntimeError("IndexedDatasetBuilder aborted")
            self._bin_ctx.__exit__(RuntimeError, error, None)


def write_index(idx_path, dtype, sequence_lengths, document_indices, sequence_modes=None) -> None:
    dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    documents = np.asarray(document_indices, dtype=np.int64)
    with atomic_write(idx_path, "wb") as f:
        f.write(_INDEX_HEADER)
        f.write(struct.pack("<Q", _VERSION))
        f.write(struct.pack("<B", DType.code_from_dtype(dtype)))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(documents)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(documents.tobytes(order="C"))
        if sequence_modes is not None:
            f.write(np.asarray(sequence_modes, dtype=np.int8).tobytes(order="C"))


class _Index:
    """The parsed `.idx` file; every inconsistency raises one ValueError naming the file."""

    def __init__(self, idx_path: str, multimodal: bool):
        self.path = idx_path
        try:
            size = os.path.getsize(idx_path)
        except OSError:
            raise FileNotFoundError(f"index file not found: {idx_path}") from None

        def bad(why: str):
            return ValueError(f"corrupted index file {idx_path}: {why}")

        if size < _FIXED:
            raise bad(f"{size} bytes, shorter than the {_FIXED}-byte header")
        with open(idx_path, "rb") as f:
            head = f.read(_FIXED)
        if head[:9] != _INDEX_HEADER:
            raise bad(
                f"bad magic {head[:9]!r}, expected {_INDEX_HEADER!r} (not a Megatron .idx file)"
            )
        (version,) = struct.unpack("<Q", head[9:17])
        if version != _VERSION:
            raise bad(f"unsupported version {version}, expected {_VERSION}")
        code = head[17]
        try:
            self.dtype = np.dtype(DType.dtype_from_code(code))
        except ValueError:
            raise bad(f"unknown dtype code {code}") from None
        self.sequence_count, self.document_count = struct.unpack("<QQ", head[18:34])
        s, d = self.sequence_count, self.document_count
        expected = _FIXED + s * 4 + s * 8 + d * 8 + (s if multimodal else 0)
        if size != expected:
            hint = (
                " (a multimodal index? pass multimodal=True)"
                if not multimodal and size == expected + s
                else ""
            )
            raise bad(
                f"{size} bytes, but {s} sequences and {d} document indices need {expected}{hint}"
            )
        self._mmap = np.memmap(idx_path, mode="r", dtype=np.uint8)
        buf = self._mmap
        o = _FIXED
        self.sequence_lengths = np.frombuffer(buf, np.int32, s, o)
        o += s * 4
        self.sequence_pointers = np.frombuffer(buf, np.int64, s, o)
        o += s * 8
        self.document_indices = np.frombuffer(buf, np.int64, d, o)
        o += d * 8
        self.sequence_modes = np.frombuffer(buf, np.int8, s, o) if multimodal else None
        if d < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != s:
            raise bad(f"document indices must run from 0 to the sequence count {s}")
        if d > 1 and np.any(np.diff(self.document_indices) < 0):
            raise bad("document indices are not non-decreasing")
        if np.any(self.sequence_lengths < 0):
            raise bad("negative sequence length")
        if s:
            steps = self.sequence_lengths[:-1].astype(np.int64) * self.dtype.itemsize
            if self.sequence_pointers[0] != 0 or np.any(np.diff(self.sequence_pointers) != steps):
                raise bad("sequence pointers do not match the sequence lengths")

    @property
    def total_bytes(self) -> int:
        if not self.sequence_count:
            return 0
        return (
            int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
        )


class IndexedDataset:
    """Read-only view of a `.bin`/`.idx` pair at `path_prefix` (no extension).

    `ds[i]` is sequence i as a numpy array (a view into the mmap); `ds[a:b]` a list of them;
    `ds.get(i, offset, length)` a slice of sequence i.
    """

    def __init__(
        self, path_prefix: str | os.PathLike[str], multimodal: bool = False, mmap: bool = True
    ):
        self.path_prefix = str(path_prefix)
        self.index = _Index(index_file_path(path_prefix), multimodal)
        bin_path = data_file_path(path_prefix)
        if not os.path.exists(bin_path):
            raise FileNotFoundError(f"data file not found: {bin_path}")
        size = os.path.getsize(bin_path)
        if size != self.index.total_bytes:
            raise ValueError(
                f"corrupted index file {self.index.path}: it describes {self.index.total_bytes} bytes "
                f"of {self.dtype.name} tokens but {bin_path} has {size} bytes"
            )
        if size == 0:
            self._bin = np.zeros(0, dtype=np.uint8)
        elif mmap:
            self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8)
        else:
            self._bin = np.fromfile(bin_path, dtype=np.uint8)

    @staticmethod
    def exists(path_prefix: str | os.PathLike[str]) -> bool:
        return os.path.exists(index_file_path(path_prefix)) and os.path.exists(
            data_file_path(path_prefix)
        )

    @property
    def dtype(self) -> np.dtype:
        return self.index.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self.index.sequence_lengths

    @property
    def document_indices(self) -> np.ndarray:
        return self.index.document_indices

    @property
    def sequence_modes(self) -> np.ndarray | None:
        return self.index.sequence_modes

    @property
    def num_documents(self) -> int:
        return len(self.index.document_indices) - 1

    def __len__(self) -> int:
        return self.index.sequence_count

    def _read(self, pointer: int, count: int) -> np.ndarray:
        return np.frombuffer(self._bin, dtype=self.dtype, count=count, offset=pointer)

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            n = len(self)
            if idx < 0:
                idx += n
            if not 0 <= idx < n:
                raise IndexError(
                    f"sequence {idx} out of range for {n} sequences in {self.path_prefix}"
                )
            return self._read(
                int(self.index.sequence_pointers[idx]), int(self.index.sequence_lengths[idx])
            )
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices of an IndexedDataset must be contiguous")
            return [self[i] for i in range(start, stop)]
        raise TypeError(f"indices must be ints or slices, not {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Elements `offset : offset + length` of sequence `idx` (to its end if length is None)."""
        n = int(self.index.sequence_lengths[idx])
        if length is None:
            length = n - offset
        if offset < 0 or length < 0 or offset + length > n:
            raise IndexError(
                f"get({idx}, offset={offset}, length={length}) outside a sequence of {n} elements"
            )
        pointer = int(self.index.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return self._read(pointer, length)


def build_from_documents(
    path_prefix: str | os.PathLike[str], documents, dtype=np.int32
) -> IndexedDataset:
    """Write one sequence per document of `documents` (iterable of token lists) and open it."""
    Path(str(path_prefix)).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(data_file_path(path_prefix), dtype=dtype)
    for doc in documents:
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(index_file_path(path_prefix))
    return IndexedDataset(path_prefix)
