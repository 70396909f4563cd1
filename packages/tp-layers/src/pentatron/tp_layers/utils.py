"""Small helpers: resolving the tensor-parallel group, checked division, splits, vocab ranges.

`resolve_group(tp_group)` accepts what a user of tp-layers may hold: a torch ProcessGroup, a
1-D `DeviceMesh`, a `(DeviceMesh, dim_name)` pair, or None for the default grid's "tp" group
set by `pentatron.parallel_state.initialize_model_parallel`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


class TPConfigError(ValueError):
    """A layer argument that cannot work with this tensor-parallel size.

    The message names the field, the rule and a fix.
    """


def resolve_group(tp_group: Any = None) -> Any:
    """The ProcessGroup to communicate over (see the module docstring for accepted forms)."""
    if tp_group is None:
        from pentatron.parallel_state import get_default_grid, model_parallel_is_initialized

        if not dist.is_initialized() and not model_parallel_is_initialized():
            return None  # one process, no torch.distributed: every layer is local
        return get_default_grid().group("tp")
    if isinstance(tp_group, tuple) and len(tp_group) == 2:
        mesh, dim = tp_group
        return mesh.get_group(dim)
    if _is_device_mesh(tp_group):
        if tp_group.ndim != 1:
            raise TPConfigError(
                f"tp_group: a DeviceMesh with {tp_group.ndim} dimensions is ambiguous; the "
                "rule: pass a 1-D mesh or a (mesh, dim_name) pair; fix: tp_group=(mesh, 'tp')"
            )
        return tp_group.get_group()
    return tp_group


def _is_device_mesh(obj: Any) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - very old torch
        return False
    return isinstance(obj, DeviceMesh)


def group_size(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group: Any) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def divide(numerator: int, denominator: int, field: str, fix: str = "") -> int:
    """`numerator // denominator`, or a `TPConfigError` naming `field` when it does not divide."""
    if numerator % denominator:
        hint = fix or f"choose {field} as a multiple of {denominator}"
        raise TPConfigError(
            f"{field}={numerator} is not divisible by the tensor-parallel size {denominator}; "
            f"the rule: each of the {denominator} ranks holds an equal shard; fix: {hint}"
        )
    return numerator // denominator


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous: bool = False
) -> Sequence[torch.Tensor]:
    """`[..., n]` -> `num_partitions` views `[..., n/num_partitions]`."""
    last = divide(tensor.size(-1), num_partitions, "tensor.size(-1)")
    chunks = torch.split(tensor, last, dim=-1)
    return tuple(c.contiguous() for c in chunks) if contiguous else chunks


def vocab_range(global_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """`[first, last)` of the vocabulary held by `rank` of `world_size` equal shards."""
    per_partition = divide(
        global_vocab_size,
        world_size,
        "num_embeddings (vocabulary size)",
        fix="pad the vocabulary with pad_vocab_size(vocab_size, tp_size)",
    )
    first = rank * per_partition
    return first, first + per_partition


def pad_vocab_size(vocab_size: int, tp_size: int, make_vocab_size_divisible_by: int = 128) -> int:
    """Smallest size >= `vocab_size` that is a multiple of `make_vocab_size_divisible_by * tp`.

    Megatron pads so every tp shard has the same, GEMM-friendly width; the extra rows are
    never the target of a real token.
    """
    for name, value in (
        ("vocab_size", vocab_size),
        ("tp_size", tp_size),
        ("make_vocab_size_divisible_by", make_vocab_size_divisible_by),
    ):
        if not isinstance(value, int) or value < 1:
            raise TPConfigError(f"{name}={value!r}: must be a positive integer")
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def set_tensor_model_parallel_attributes(
    param: torch.Tensor, is_parallel: bool, dim: int, stride: int
) -> None:
    """Mark a parameter as a tp shard (read by grad clipping, checkpointing, DDP)."""
    # Attributes set at runtime on the Parameter: torch stubs lack all three.
    param.tensor_model_parallel = is_parallel  # type: ignore[attr-defined]
    param.partition_dim = dim  # type: ignore[attr-defined]
    param.partition_stride = stride  # type: ignore[attr-defined]
