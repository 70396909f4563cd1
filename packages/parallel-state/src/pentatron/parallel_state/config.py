"""`ParallelConfig`: the sizes of the 5-D grid, validated before any process group exists."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from math import prod

DIMENSIONS = ("tp", "cp", "ep", "dp", "pp")
"""Tokens an `order` string may contain, one per grid dimension."""

DEFAULT_ORDER = "tp-cp-ep-dp-pp"


class ParallelConfigError(ValueError):
    """A parallel layout that cannot work; the message names the field, the rule and a fix."""


def parse_order(order: str) -> list[str]:
    """Split an order string (fastest- to slowest-varying) and check each token once."""
    tokens = order.split("-")
    for token in tokens:
        if token not in DIMENSIONS:
            raise ParallelConfigError(
                f"order={order!r}: unknown token {token!r}; "
                f"the rule: tokens are {', '.join(DIMENSIONS)} joined by '-'; "
                f"fix: use e.g. {DEFAULT_ORDER!r}"
            )
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        raise ParallelConfigError(
            f"order={order!r}: token(s) {', '.join(repeated)} repeated; "
            f"the rule: each dimension appears at most once; fix: e.g. {DEFAULT_ORDER!r}"
        )
    return tokens


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ParallelConfigError(
            f"{name}={value!r}: must be a positive integer; fix: set {name} >= 1"
        )


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the parallel grid (Megatron's names in comments).

    The dense layers use the grid tp x cp x dp x pp, the expert layers etp x ep x edp x pp
    over the same ranks. dp and edp are derived from the world size (`resolve`).
    """

    tp: int = 1  # tensor_model_parallel_size
    pp: int = 1  # pipeline_model_parallel_size
    vpp: int | None = None  # virtual_pipeline_model_parallel_size (model chunks per rank)
    cp: int = 1  # context_parallel_size
    ep: int = 1  # expert_model_parallel_size
    etp: int | None = None  # expert_tensor_parallel_size; None means "same as tp"
    dp: int | None = None  # data_parallel_size; None means "derive from the world size"
    order: str = DEFAULT_ORDER
    timeout: timedelta = field(default_factory=lambda: timedelta(minutes=10))
    # hierarchical_context_parallel_sizes: each cp group split into levels, the first the
    # fastest-varying (consecutive cp ranks), e.g. (2, 4) = cp pairs inside, then groups of 4
    hierarchical_cp: tuple[int, ...] | None = None
    # the pipeline ranks of each embedding group (Megatron's get_embedding_ranks); None: the
    # first and the last. A standalone MTP stage holds an embedding copy on its own rank.
    embedding_pp_ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            _positive(name, getattr(self, name))
        for name in ("vpp", "etp", "dp"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.vpp is not None and self.vpp > 1 and self.pp == 1:
            raise ParallelConfigError(
                f"vpp={self.vpp} with pp=1: virtual pipeline stages interleave chunks across "
                "pipeline ranks, so they need pp > 1; fix: set pp > 1 or drop vpp"
            )
        tokens = parse_order(self.order)
        for name in DIMENSIONS:
            size = self.dp if name == "dp" else getattr(self, name)
            if name not in tokens and size not in (None, 1):
                raise ParallelConfigError(
                    f"order={self.order!r} lacks {name!r} but {name}={size}; the rule: every "
                    f"dimension larger than 1 must be placed in the order; fix: add {name!r}"
                )
        self._check_hierarchical_cp()
        self._check_embedding_pp_ranks()
        if not isinstance(self.timeout, timedelta) or self.timeout.total_seconds() <= 0:
            raise ParallelConfigError(
                f"timeout={self.timeout!r}: must be a positive datetime.timedelta; "
                "fix: e.g. timeout=timedelta(minutes=10)"
            )

    def _check_hierarchical_cp(self) -> None:
        sizes = self.hierarchical_cp
        if sizes is None:
            return
        if not isinstance(sizes, tuple) or not sizes:
            raise ParallelConfigError(
                f"hierarchical_cp={sizes!r}: must be a non-empty tuple of sizes; fix: e.g. "
                f"hierarchical_cp=(2, {max(self.cp // 2, 1)}) for cp={self.cp}"
            )
        for size in sizes:
            _positive("hierarchical_cp entry", size)
        if prod(sizes) != self.cp:
            raise ParallelConfigError(
                f"hierarchical_cp={sizes} with cp={self.cp}: the rule: the levels' sizes "
                f"multiply to cp (here {prod(sizes)}); fix: sizes whose product is {self.cp}, "
                "or hierarchical_cp=None"
            )

    def _check_embedding_pp_ranks(self) -> None:
        ranks = self.embedding_pp_ranks
        if ranks is None:
            return
        ok = (
            isinstance(ranks, tuple)
            and all(isinstance(r, int) and not isinstance(r, bool) for r in ranks)
            and list(ranks) == sorted(set(ranks))
            and ranks[:1] == (0,)
            and all(0 <= r < self.pp for r in ranks)
        )
        if not ok:
            raise ParallelConfigError(
                f"embedding_pp_ranks={ranks!r} with pp={self.pp}: the rule: a sorted tuple of "
                "distinct pipeline ranks in [0, pp) starting with 0 (the embedding's stage); "
                f"fix: e.g. (0, {self.pp - 1}), or None for the first and the last"
            )

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def resolve(self, world_size: int) -> ResolvedLayout:
        """Check the sizes against `world_size` and derive dp and edp."""
        _positive("world_size", world_size)
        dense = self.tp * self.cp * self.pp
        if world_size % dense:
            raise ParallelConfigError(
                f"world_size={world_size} is not divisible by tp*cp*pp = {self.tp}*{self.cp}*"
                f"{self.pp} = {dense}; the rule: world_size = tp*cp*dp*pp; fix: launch a "
                f"multiple of {dense} processes or change tp, cp or pp"
            )
        dp = world_size // dense
        if self.dp is not None and self.dp != dp:
            raise ParallelConfigError(
                f"dp={self.dp} but world_size / (tp*cp*pp) = {world_size}/{dense} = {dp}; "
                f"fix: set dp={dp} or leave it unset to derive it"
            )
        expert = self.expert_tp * self.ep * self.pp
        if world_size % expert:
            raise ParallelConfigError(
                f"etp*ep*pp = {self.expert_tp}*{self.ep}*{self.pp} = {expert} does not divide "
                f"world_size={world_size}; the rule: world_size = etp*ep*edp*pp for the expert "
                "grid; fix: change ep or etp (etp defaults to tp)"
            )
        return ResolvedLayout(
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            dp=dp,
            ep=self.ep,
            etp=self.expert_tp,
            edp=world_size // expert,
            vpp=self.vpp,
            order=self.order,
            hierarchical_cp=self.hierarchical_cp,
            embedding_pp_ranks=self.embedding_pp_ranks,
        )


@dataclass(frozen=True)
class ResolvedLayout:
    """All grid sizes, consistent with one world size (made by `ParallelConfig.resolve`)."""

    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    etp: int
    edp: int
    vpp: int | None
    order: str
    hierarchical_cp: tuple[int, ...] | None = None
    embedding_pp_ranks: tuple[int, ...] | None = None

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp
