"""Every group family Megatron creates, as rank lists, for one resolved layout (no processes)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .config import ParallelConfigError, ResolvedLayout
from .rank_generator import RankGenerator

DENSE_FAMILIES = {
    "tp": "tp",
    "pp": "pp",
    "dp": "dp",
    "cp": "cp",
    "dp-cp": "dp-cp",
    "tp-cp": "tp-cp",
    "tp-pp": "tp-pp",  # Megatron's model-parallel group
    "tp-dp": "tp-dp",
    "tp-dp-cp": "tp-dp-cp",
}
EXPERT_FAMILIES = {  # token in the expert grid, where its "tp" is the expert-tensor dimension
    "ep": "ep",
    "etp": "tp",
    "edp": "dp",
    "etp-ep": "tp-ep",
    "etp-ep-pp": "tp-ep-pp",  # expert model-parallel group
}
ALIASES = {
    "mp": "tp-pp",
    "model": "tp-pp",
    "tp-ep": "etp-ep",
    "expert-mp": "etp-ep-pp",
    "embd": "embedding",
    "pos-embd": "position-embedding",
}
FAMILIES = (*DENSE_FAMILIES, *EXPERT_FAMILIES, "embedding", "position-embedding")


def canonical(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in FAMILIES:
        raise KeyError(
            f"unknown group {name!r}; known: {', '.join(FAMILIES)} (aliases: {', '.join(ALIASES)})"
        )
    return name


@dataclass(frozen=True)
class GridLayout:
    """The rank lists of every group family of `layout`.

    Embedding groups hold the first and last rank of each pipeline group (one rank when
    pp=1), or the pipeline ranks `embedding_pp_ranks` names; position-embedding groups hold
    the first. They cover only those ranks.
    """

    layout: ResolvedLayout

    @cached_property
    def dense(self) -> RankGenerator:
        lay = self.layout
        return RankGenerator(tp=lay.tp, ep=1, dp=lay.dp, pp=lay.pp, cp=lay.cp, order=lay.order)

    @cached_property
    def expert(self) -> RankGenerator:
        lay = self.layout
        return RankGenerator(tp=lay.etp, ep=lay.ep, dp=lay.edp, pp=lay.pp, cp=1, order=lay.order)

    @cached_property
    def families(self) -> dict[str, list[list[int]]]:
        out = {name: self.dense.get_ranks(tok) for name, tok in DENSE_FAMILIES.items()}
        out.update({name: self.expert.get_ranks(tok) for name, tok in EXPERT_FAMILIES.items()})
        if out["pp"] != self.expert.get_ranks("pp"):
            raise ParallelConfigError(
                f"order={self.layout.order!r} gives different pipeline groups to the dense grid "
                f"(tp*cp={self.layout.tp * self.layout.cp} ranks below pp) and the expert grid "
                f"(etp*ep={self.layout.etp * self.layout.ep}); the rule: both grids must share "
                "their pipeline groups; fix: put 'pp' last in the order or make etp*ep = tp*cp"
            )
        stages = self.layout.embedding_pp_ranks or (0, self.layout.pp - 1)
        out["embedding"] = [sorted({g[i] for i in stages}) for g in out["pp"]]
        out["position-embedding"] = [[g[0]] for g in out["pp"]]
        return out

    @cached_property
    def hierarchical_cp(self) -> list[list[list[int]]]:
        """Per level of `layout.hierarchical_cp`, every group of that level ([] without it).

        Megatron's `create_hierarchical_groups` on each cp group `ranks` with sizes
        (a, b, ...): level 0 joins a consecutive members (ranks[k a : k a + a]), level 1
        joins b members a apart, and so on; e.g. cp ranks [0, 2, 4, 6] with (2, 2) give
        level 0 [0, 2], [4, 6] and level 1 [0, 4], [2, 6].
        """
        sizes = self.layout.hierarchical_cp
        if not sizes:
            return []
        levels: list[list[list[int]]] = [[] for _ in sizes]
        for ranks in self.families["cp"]:
            below = 1  # the members' stride at this level: the sizes of the levels below
            for level, size in enumerate(sizes):
                span = below * size
                for base in range(0, len(ranks), span):
                    for j in range(below):
                        levels[level].append([ranks[base + j + i * below] for i in range(size)])
                below = span
        return levels

    def ranks(self, name: str, rank: int) -> list[int] | None:
        """The group of `name` that holds `rank`, or None (embedding groups skip middle stages)."""
        for group in self.families[canonical(name)]:
            if rank in group:
                return group
        return None
