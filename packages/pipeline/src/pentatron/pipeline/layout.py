"""Stage layout: which of L layers each (pipeline rank, chunk) builds.

Chunk c of pipeline rank r is virtual stage s = c * p + r; layers are numbered along the
virtual stages (Megatron's round-robin assignment), so chunk 0 of every rank comes first.
As in Megatron-LM (`get_num_layers_to_build`, `get_transformer_layer_offset`):
- even split: (L [+1 embedding] [+1 loss]) / p per rank, / v per chunk; with
  `account_for_embedding` the first virtual stage builds one layer fewer (the embedding
  takes its slot), with `account_for_loss` the last one does;
- uneven split: `first_stage_layers` / `last_stage_layers` (Megatron's
  decoder_first/last_pipeline_num_layers) fix the first / last rank, the rest is spread
  evenly over the middle ranks;
- custom: `stage_layers` gives each virtual stage's count in model order (Megatron's
  --pipeline-model-parallel-layout, parsed by `custom_layout.PipelineLayout`); a stage
  may hold none.
Every impossible split raises `PipelineConfigError` naming the field, the rule and a fix.

`placement="v"` (ZBV, two chunks per rank): chunk 0 of rank r is stage r and chunk 1 is
stage 2p - 1 - r (`zero_bubble.v_stage`), so rank 0 holds the first and the last stage;
layers still follow the stages, even split only.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import PipelineConfigError


@dataclass(frozen=True)
class StageLayout:
    num_layers: int
    pp: int
    vpp: int | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    account_for_embedding: bool = False
    account_for_loss: bool = False
    placement: str = "loop"  # "loop": Megatron's round robin; "v": ZBV's V (vpp 2)
    stage_layers: tuple[int, ...] | None = None  # custom: layers per virtual stage

    def __post_init__(self) -> None:
        for name in ("num_layers", "pp"):
            _check_int(name, getattr(self, name), minimum=1)
        if self.vpp is not None:
            _check_int("vpp", self.vpp, minimum=1)
        uneven = self.first_stage_layers is not None or self.last_stage_layers is not None
        if self.placement not in ("loop", "v"):
            raise PipelineConfigError(
                f"placement={self.placement!r}: the rule: 'loop' (round robin) or 'v' (ZBV); "
                "fix: use one of them"
            )
        if self.placement == "v" and (self.vpp != 2 or uneven):
            raise PipelineConfigError(
                f"placement='v' with vpp={self.vpp}, first_stage_layers="
                f"{self.first_stage_layers}, last_stage_layers={self.last_stage_layers}: the "
                "rule: the V has two chunks per rank and an even split; fix: vpp=2 and leave "
                "the first/last stage sizes unset"
            )
        if uneven and (self.account_for_embedding or self.account_for_loss):
            raise PipelineConfigError(
                "first_stage_layers/last_stage_layers with account_for_embedding/"
                "account_for_loss: the rule (Megatron-LM): an uneven split already says where "
                "layers go; fix: use one of the two ways"
            )
        if self.stage_layers is not None:
            self._check_custom(uneven)
        elif uneven:
            self._check_uneven()
        else:
            self._check_even()

    @property
    def chunks(self) -> int:
        return self.vpp or 1

    # --- validation ------------------------------------------------------------------------
    def _check_even(self) -> None:
        slots = self.num_layers + self.account_for_embedding + self.account_for_loss
        extra = (
            " (+1 embedding)" * self.account_for_embedding + " (+1 loss)" * self.account_for_loss
        )
        if slots % self.pp:
            raise PipelineConfigError(
                f"num_layers={self.num_layers}{extra} = {slots} is not divisible by pp={self.pp}; "
                f"the rule: every pipeline rank gets the same number of layers; fix: use a "
                f"multiple of {self.pp} layers, or set first_stage_layers/last_stage_layers"
            )
        if (slots // self.pp) % self.chunks:
            raise PipelineConfigError(
                f"num_layers={self.num_layers}{extra}: {slots // self.pp} layers per pipeline "
                f"rank are not divisible by vpp={self.vpp}; the rule: each of the vpp chunks of "
                f"a rank gets the same number of layers; fix: use a multiple of "
                f"{self.pp * self.chunks} layers or another vpp"
            )

    def _check_custom(self, uneven: bool) -> None:
        layers = self.stage_layers
        assert layers is not None
        if (
            uneven
            or self.account_for_embedding
            or self.account_for_loss
            or self.placement != "loop"
        ):
            raise PipelineConfigError(
                "stage_layers with first_stage_layers/last_stage_layers, account_for_embedding/"
                "account_for_loss or placement='v': the rule (Megatron-LM): a custom layout "
                "already says where every layer goes, in round-robin stage order; fix: use "
                "one of the ways"
            )
        if len(layers) != self.pp * self.chunks:
            raise PipelineConfigError(
                f"stage_layers has {len(layers)} stages for pp={self.pp} x vpp={self.vpp}; the "
                f"rule: one count per virtual stage; fix: give {self.pp * self.chunks} counts"
            )
        for n in layers:
            _check_int("stage_layers[i]", n, minimum=0)
        if sum(layers) != self.num_layers:
            raise PipelineConfigError(
                f"stage_layers={list(layers)} hold {sum(layers)} layers, num_layers="
                f"{self.num_layers}; fix: make them add up to num_layers"
            )

    def _check_uneven(self) -> None:
        first, last = self.first_stage_layers, self.last_stage_layers
        for name, value in (("first_stage_layers", first), ("last_stage_layers", last)):
            if value is not None:
                _check_int(name, value, minimum=0)
                if value % self.chunks:
                    raise PipelineConfigError(
                        f"{name}={value} is not divisible by vpp={self.vpp}; the rule: the "
                        f"rank's chunks share its layers evenly; fix: use a multiple of {self.vpp}"
                    )
        if self.pp == 1:
            raise PipelineConfigError(
                "first_stage_layers/last_stage_layers with pp=1: there is one stage; "
                "fix: leave them unset"
            )
        middle_ranks = self.pp - (first is not None) - (last is not None)
        rest = self.num_layers - (first or 0) - (last or 0)
        if rest < 0 or (middle_ranks == 0 and rest) or (middle_ranks and rest % middle_ranks):
            raise PipelineConfigError(
                f"num_layers={self.num_layers} with first_stage_layers={first}, "
                f"last_stage_layers={last}: {rest} layers remain for {middle_ranks} middle "
                f"rank(s); the rule: the rest splits evenly over the other pipeline ranks; "
                f"fix: change num_layers or the first/last stage sizes"
            )
        if middle_ranks and (rest // middle_ranks) % self.chunks:
            raise PipelineConfigError(
                f"{rest // middle_ranks} layers per middle pipeline rank are not divisible by "
                f"vpp={self.vpp}; fix: change num_layers or the first/last stage sizes"
            )

    # --- queries ---------------------------------------------------------------------------
    def _rank_slots(self, pp_rank: int) -> int:
        first, last = self.first_stage_layers, self.last_stage_layers
        if first is None and last is None:
            return (self.num_layers + self.account_for_embedding + self.account_for_loss) // self.pp
        if pp_rank == 0 and first is not None:
            return first
        if pp_rank == self.pp - 1 and last is not None:
            return last
        middle = self.pp - (first is not None) - (last is not None)
        return (self.num_layers - (first or 0) - (last or 0)) // middle

    def stage(self, pp_rank: int, chunk: int = 0) -> int:
        """The virtual stage of chunk `chunk` of pipeline rank `pp_rank` (0: the embedding,
        p * chunks - 1: the loss)."""
        self._check_position(pp_rank, chunk)
        if self.placement == "v":
            return pp_rank if chunk == 0 else 2 * self.pp - 1 - pp_rank
        return chunk * self.pp + pp_rank

    def position(self, stage: int) -> tuple[int, int]:
        """(pp_rank, chunk) holding virtual stage `stage`: the inverse of `stage`."""
        if not 0 <= stage < self.pp * self.chunks:
            raise ValueError(f"stage={stage} outside pp={self.pp} x chunks={self.chunks}")
        chunk, rank = divmod(stage, self.pp)
        if self.placement == "v" and chunk == 1:
            rank = self.pp - 1 - rank
        return rank, chunk

    def num_layers_to_build(self, pp_rank: int, chunk: int = 0) -> int:
        """Transformer layers of chunk `chunk` on pipeline rank `pp_rank`."""
        stage = self.stage(pp_rank, chunk)
        if self.stage_layers is not None:
            return self.stage_layers[stage]
        n = self._rank_slots(pp_rank) // self.chunks
        if self.account_for_embedding and stage == 0:
            n -= 1
        if self.account_for_loss and stage == self.pp * self.chunks - 1:
            n -= 1
        return n

    def layer_offset(self, pp_rank: int, chunk: int = 0) -> int:
        """Global index of the first layer of that chunk (layers follow virtual stages)."""
        stage = self.stage(pp_rank, chunk)
        return sum(self.num_layers_to_build(*self.position(s)) for s in range(stage))

    def layers(self, pp_rank: int, chunk: int = 0) -> range:
        start = self.layer_offset(pp_rank, chunk)
        return range(start, start + self.num_layers_to_build(pp_rank, chunk))

    def _check_position(self, pp_rank: int, chunk: int) -> None:
        if not 0 <= pp_rank < self.pp or not 0 <= chunk < self.chunks:
            raise ValueError(
                f"(pp_rank={pp_rank}, chunk={chunk}) outside pp={self.pp}, vpp={self.vpp}"
            )


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise PipelineConfigError(
            f"{name}={value!r}: must be an integer >= {minimum}; fix: set {name} >= {minimum}"
        )
