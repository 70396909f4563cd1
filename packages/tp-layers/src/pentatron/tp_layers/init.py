"""Weight initialisation on the full master weight, then split into this rank's shard.

Every rank draws the whole `[out, in]` master weight from the default CPU generator (same
seed on every rank of a tp group) and keeps its shard, so a TP=t layer holds exactly the
slices of the TP=1 layer built with the same seed, whatever t is and on any device.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .utils import TPConfigError

InitMethod = Callable[[torch.Tensor], object]


def init_method_normal(sigma: float) -> InitMethod:
    """`N(0, sigma^2)` (Megatron's default, sigma = 0.02)."""

    def init_(tensor: torch.Tensor) -> object:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int) -> InitMethod:
    """`N(0, (sigma / sqrt(2 L))^2)`, for output projections of residual branches."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def shard_of(
    master: torch.Tensor, partition_dim: int, rank: int, world_size: int, stride: int = 1
) -> torch.Tensor:
    """This rank's shard of `master` along `partition_dim`.

    With `stride` k the dim is viewed as k blocks (e.g. the q, k, v of a fused QKV weight),
    and each rank takes its 1/world_size of every block, in block order.
    """
    size = master.size(partition_dim)
    if size % (world_size * stride):
        raise TPConfigError(
            f"partition dim of size {size} is not divisible by tp size * stride = "
            f"{world_size} * {stride}; the rule: each of the {stride} fused blocks is split "
            f"evenly over {world_size} ranks; fix: make it a multiple of {world_size * stride}"
        )
    chunks = torch.split(master, size // (world_size * stride), dim=partition_dim)
    return torch.cat(chunks[rank::world_size], dim=partition_dim)


def init_sharded_(
    shard: torch.Tensor,
    full_shape: tuple[int, ...],
    init_method: InitMethod,
    partition_dim: int,
    rank: int,
    world_size: int,
    stride: int = 1,
) -> None:
    """Fill `shard` in place with this rank's part of `init_method(master of full_shape)`."""
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    part = shard_of(master, partition_dim, rank, world_size, stride)
    with torch.no_grad():
        shard.copy_(part.to(dtype=shard.dtype))
