"""Rank lists of every group of a grid, computed without processes (Megatron's RankGenerator).

An order string lists the dimensions from fastest- to slowest-varying in the global rank:
with order "tp-cp-ep-dp-pp", rank = tp_r + tp*(cp_r + cp*(ep_r + ep*(dp_r + dp*pp_r))).
The groups of a token such as "tp-pp" are the sets of ranks that differ only in those
dimensions; inside a group ranks are listed with the first named dimension fastest.
"""

from __future__ import annotations

import itertools
from math import prod

from .config import DIMENSIONS, ParallelConfigError, parse_order


def masked_rank_groups(sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """Groups of the dimensions where `mask` is True, for a grid with `sizes` (fastest first).

    Groups are enumerated with the first unmasked dimension varying fastest, and ranks in a
    group with the first masked dimension varying fastest, which is Megatron's order.
    """
    strides = [prod(sizes[:i]) for i in range(len(sizes))]
    inner = [(s, st) for s, st, m in zip(sizes, strides, mask) if m]
    outer = [(s, st) for s, st, m in zip(sizes, strides, mask) if not m]

    def offsets(dims: list[tuple[int, int]]) -> list[int]:
        # itertools.product varies its last argument fastest, so feed dimensions reversed.
        ranges = [range(0, size * stride, stride) for size, stride in reversed(dims)]
        return [sum(combo) for combo in itertools.product(*ranges)]

    members = offsets(inner)
    return [[base + m for m in members] for base in offsets(outer)]


class RankGenerator:
    """Megatron-LM's `RankGenerator(tp, ep, dp, pp, cp, order)`.

    Dimensions of size 1 missing from `order` are appended (they do not change any rank);
    a dimension larger than 1 must be named.
    """

    def __init__(
        self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0
    ) -> None:
        self.sizes = {"tp": tp, "ep": ep, "dp": dp, "pp": pp, "cp": cp}
        self.world_size = prod(self.sizes.values())
        self.rank_offset = rank_offset
        tokens = parse_order(order)
        for name in DIMENSIONS:
            if name not in tokens:
                if self.sizes[name] != 1:
                    raise ParallelConfigError(
                        f"order={order!r} lacks {name!r} but its size is {self.sizes[name]}; "
                        f"fix: add {name!r} to the order"
                    )
                tokens.append(name)
        self.order = tokens
        self.ordered_sizes = [self.sizes[t] for t in tokens]

    def get_mask(self, token: str) -> list[bool]:
        wanted = parse_order(token)
        return [t in wanted for t in self.order]

    def get_ranks(self, token: str) -> list[list[int]]:
        """Every group of the dimensions named in `token` (e.g. "tp", "dp-cp", "tp-pp")."""
        groups = masked_rank_groups(self.ordered_sizes, self.get_mask(token))
        if self.rank_offset:
            groups = [[r + self.rank_offset for r in g] for g in groups]
        return groups

    def coordinates(self, rank: int) -> dict[str, int]:
        """The index of `rank` along each dimension."""
        coords, rest = {}, rank - self.rank_offset
        for name, size in zip(self.order, self.ordered_sizes):
            coords[name] = rest % size
            rest //= size
        return coords
