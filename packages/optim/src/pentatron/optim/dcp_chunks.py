"""DCP planners for n-D chunks of global tensors, written and read in place.

Shared by the optimizer checkpoints here (flat pieces: 1-D chunks) and the training app's
model/optimizer checkpoints (tp-shard rectangles).

A state dict here maps a key to a plain tensor (stored whole) or to `GlobalChunks`: this
rank's rectangles of a global tensor of shape `size`, each `(offsets, tensor)`. Every rank
lists only the chunks it writes (a value lives on exactly one writer), and DCP checks that
the chunks of each key tile the whole tensor. On load each rank asks for the rectangles of
its own (new) layout; DCP reads the overlapping parts of the saved chunks. Everything is a
tensor, loaded with `torch.load(weights_only=True)`; nothing goes through pickled bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


@dataclass
class GlobalChunks:
    """This rank's rectangles `(offsets, tensor)` of one global tensor of shape `size`."""

    size: tuple[int, ...]
    chunks: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)

    def add(self, offsets: tuple[int, ...], tensor: torch.Tensor) -> None:
        if any(o == offsets for o, _ in self.chunks):
            raise ValueError(f"two chunks at offsets {offsets} of one tensor on one rank")
        self.chunks.append((tuple(offsets), tensor))

    def at(self, offsets: tuple[int, ...]) -> torch.Tensor:
        for o, t in self.chunks:
            if o == tuple(offsets):
                return t
        raise KeyError(offsets)


def _write_item(fqn: str, offsets: tuple[int, ...], t: torch.Tensor, size: torch.Size):
    kind = WriteItemType.SHARD if t.size() != size else WriteItemType.TENSOR
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offsets)),
        type=kind,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.size()),
            properties=TensorProperties.create_from_tensor(t),
            size=size,
        ),
    )


class ChunkSavePlanner(DefaultSavePlanner):
    """Plain tensors whole, `GlobalChunks` as shards at their offsets."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, GlobalChunks):
                size = torch.Size(obj.size)
                items += [_write_item(fqn, o, t, size) for o, t in obj.chunks]
            else:
                items.append(_write_item(fqn, (0,) * obj.dim(), obj, obj.size()))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        obj = self.state_dict[write_item.index.fqn]
        if isinstance(obj, GlobalChunks):
            obj = obj.at(_chunk_offset(write_item.index))
        return obj.detach().contiguous().clone()  # a view would save its whole storage


class ChunkLoadPlanner(DefaultLoadPlanner):
    """Fills each `GlobalChunks` rectangle (and plain tensor) in place."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator=False
    ) -> None:
        self.state_dict = self.original_state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        requests: list[ReadItem] = []
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata[fqn]  # presence checked by the caller
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(
                    f"{fqn}: the checkpoint holds bytes there, not a tensor; these planners "
                    "load tensors only"
                )
            if isinstance(obj, GlobalChunks):
                chunks = [ChunkStorageMetadata(torch.Size(o), t.size()) for o, t in obj.chunks]
            else:
                chunks = [ChunkStorageMetadata(torch.Size([0] * obj.dim()), obj.size())]
            requests += create_read_items_for_chunk_list(fqn, md, chunks)
        return LoadPlan(requests)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, GlobalChunks):
            return obj.at(_chunk_offset(index))
        return obj


def _chunk_offset(index: MetadataIndex) -> tuple[int, ...]:
    """The offsets of the chunk `index` names (set on every item the planners above make)."""
    if index.offset is None:
        raise ValueError(f"{index.fqn}: a chunk's index has no offset; the planners set one")
    return tuple(index.offset)
