"""Megatron-LM's custom pipeline layout (`--pipeline-model-parallel-layout`): what each
virtual stage holds, written as a string.

    layout = PipelineLayout.parse("Et*3|(tt|)*29,m|L", pp=16)    # DeepSeek-V3, PP16 VPP2
    layout.vpp                  # 2: the number of stages / pp
    layout.decoder_layers()     # transformer layers per virtual stage, in model order
    print(layout.table())       # which layers each (pp rank, vpp rank) holds

The format (Megatron-LM's `PipelineParallelLayerLayout`): one letter per layer, `E` the
embedding, `t` a transformer (decoder) layer, `m` a multi-token-prediction layer, `L` the
loss (final norm and output layer); `|` separates virtual stages, in model order (stage
s = vpp_rank * pp + pp_rank, Megatron's round robin); `x*n` repeats one letter and
`(...)*n` a group (which may hold `|`); commas are cosmetic. A stage may be empty. The list
form takes one list per stage of letters or Megatron's layer-type names ("embedding",
"decoder", "mtp", "loss").

Rules (Megatron's `validate_layer_layout`): the number of stages is a multiple of pp; E
first and L last, once each; as many t's as the model has layers and as many m's as MTP
layers, every m after the last t, all m's in one stage, the last virtual stage of its
pipeline rank. The m's may share the last stage with L, or sit in a stage of their own
before it (Megatron's standalone MTP, `mtp_standalone`), but then not on pipeline rank 0,
which holds the embedding already. Every broken rule raises `PipelineConfigError` naming
the field, the rule and a fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .config import PipelineConfigError

FIELD = "pipeline_model_parallel_layout"
# letter -> Megatron's LayerType name
KINDS = {"E": "embedding", "t": "decoder", "m": "mtp", "L": "loss"}
_LETTER = {name: letter for letter, name in KINDS.items()}


def _fail(value: object, rule: str, fix: str) -> None:
    raise PipelineConfigError(f"{FIELD}={value!r}: {rule}; fix: {fix}")


def _expand(text: str, pos: int, depth: int, whole: str) -> tuple[str, int]:
    """Unroll `x*n` and `(...)*n` from `text[pos:]` up to a closing parenthesis (depth > 0)
    or the end; returns the unrolled letters and the position after them."""
    out: list[str] = []
    while pos < len(text):
        ch = text[pos]
        if ch == ")":
            if depth == 0:
                _fail(whole, "a ')' closes no '('", "balance the parentheses")
            return "".join(out), pos + 1
        if ch == "(":
            item, pos = _expand(text, pos + 1, depth + 1, whole)
        elif ch in KINDS or ch == "|":
            item, pos = ch, pos + 1
        else:
            _fail(
                whole,
                f"{ch!r} is not a layer letter (E embedding, t transformer layer, m MTP "
                "layer, L loss), '|', '(', ')', '*n' or ','",
                "write the layout with those only, e.g. 'Et*3|(tt|)*29,m|L'",
            )
        if text.startswith("*", pos):
            digits = ""
            pos += 1
            while pos < len(text) and text[pos].isdigit():
                digits, pos = digits + text[pos], pos + 1
            if not digits:
                _fail(whole, "'*' must be followed by a count", "write e.g. 't*3' or '(tt|)*2'")
            item *= int(digits)
        out.append(item)
    if depth:
        _fail(whole, "a '(' is never closed", "balance the parentheses")
    return "".join(out), pos


def parse_layout_string(text: str) -> list[list[str]]:
    """The stages of a layout string, each a list of letters: "E|(t|)*2,tL" ->
    [["E"], ["t"], ["t"], ["t", "L"]]."""
    letters, _ = _expand(text.replace(",", ""), 0, 0, text)
    return [list(stage) for stage in letters.split("|")]


@dataclass(frozen=True)
class PipelineLayout:
    """Each virtual stage's layers (letters of KINDS), in model order, over `pp` ranks."""

    stages: tuple[tuple[str, ...], ...]
    pp: int

    @classmethod
    def parse(cls, layout: str | Sequence[Sequence[str]], pp: int) -> PipelineLayout:
        """From Megatron's string or list form; checks the shape (stages a multiple of pp)."""
        if isinstance(layout, str):
            stages = parse_layout_string(layout)
        elif isinstance(layout, Sequence) and all(
            isinstance(s, Sequence) and not isinstance(s, str) for s in layout
        ):
            stages = [[_letter(layout, x) for x in stage] for stage in layout]
        else:
            _fail(layout, "a string or a list of lists (one per stage)", "e.g. 'E|tt|tt|L'")
        if not isinstance(pp, int) or pp < 1 or len(stages) % pp:
            _fail(
                layout,
                f"{len(stages)} stages are not a multiple of pipeline_model_parallel_size={pp} "
                "(each pp rank holds the same number of virtual stages)",
                f"write {pp} x (virtual stages per rank) stages, separated by '|'",
            )
        return cls(tuple(tuple(s) for s in stages), pp)

    @property
    def vpp(self) -> int:
        """Virtual stages per pipeline rank (1: no interleaving)."""
        return len(self.stages) // self.pp

    def decoder_layers(self) -> tuple[int, ...]:
        """Transformer layers of each virtual stage, in model order."""
        return tuple(stage.count("t") for stage in self.stages)

    def check(self, num_layers: int, mtp_num_layers: int | None) -> None:
        """Megatron's rules against the model, and ours for MTP (see the module doc)."""
        flat = [x for stage in self.stages for x in stage]
        text = "|".join("".join(s) for s in self.stages)
        if flat.count("E") != 1 or flat[0] != "E":
            _fail(text, "the embedding E comes first, exactly once", "start the layout with E")
        if flat.count("L") != 1 or flat[-1] != "L":
            _fail(text, "the loss L comes last, exactly once", "end the layout with L")
        if flat.count("t") != num_layers:
            _fail(
                text,
                f"{flat.count('t')} transformer layers (t) for num_layers={num_layers}",
                f"write {num_layers} t's",
            )
        mtp = mtp_num_layers or 0
        if flat.count("m") != mtp:
            _fail(
                text,
                f"{flat.count('m')} MTP layers (m) for mtp_num_layers={mtp_num_layers}",
                f"write {mtp} m's" + (", before L in the last stage" if mtp else ""),
            )
        if mtp and "t" in flat[flat.index("m") :]:
            _fail(
                text,
                "every MTP layer (m) comes after the last transformer layer (t)",
                "move the m's after the t's",
            )
        where = [i for i, stage in enumerate(self.stages) if "m" in stage]
        if len(where) > 1:
            _fail(text, "every MTP layer sits in one stage (Megatron-LM)", "put the m's together")
        if where and where[0] // self.pp != self.vpp - 1:
            _fail(
                text,
                "the MTP stage is the last virtual stage of its pipeline rank (Megatron-LM)",
                "move the m's to a stage of the last round of '|'-separated stages",
            )
        if self.mtp_standalone_rank == 0:
            _fail(
                text,
                "an MTP stage of its own (standalone, before the loss's) on pipeline rank 0 "
                "would hold a second embedding there",
                "move the m's to another rank's last stage, or into the last stage before L",
            )

    def mtp_stage(self) -> int | None:
        """The virtual stage holding the MTP layers (None without)."""
        where = [i for i, stage in enumerate(self.stages) if "m" in stage]
        return where[0] if where else None

    @property
    def mtp_standalone(self) -> bool:
        """The MTP layers sit in a stage before the loss's (Megatron's standalone MTP)."""
        stage = self.mtp_stage()
        return stage is not None and stage != len(self.stages) - 1

    @property
    def mtp_standalone_rank(self) -> int | None:
        """The pipeline rank of a standalone MTP stage (None without one): it holds an
        embedding copy, so the embedding group joins it to the first stage's rank."""
        stage = self.mtp_stage()
        return stage % self.pp if stage is not None and self.mtp_standalone else None

    def table(self) -> str:
        """Which layers each (pp rank, vpp rank) holds, equal ranks merged:
        `pp 0: E t*3 | t*2`."""
        rows: list[tuple[int, int, str]] = []
        for rank in range(self.pp):
            cells = [self._cell(self.stages[v * self.pp + rank]) for v in range(self.vpp)]
            row = " | ".join(cells)
            if rows and rows[-1][2] == row:
                rows[-1] = (rows[-1][0], rank, row)
            else:
                rows.append((rank, rank, row))
        return "\n".join(f"pp {a}{'' if a == b else f'-{b}'}: {row}" for a, b, row in rows)

    @staticmethod
    def _cell(stage: tuple[str, ...]) -> str:
        runs: list[list] = []
        for x in stage:
            if runs and runs[-1][0] == x:
                runs[-1][1] += 1
            else:
                runs.append([x, 1])
        return " ".join(x if n == 1 else f"{x}*{n}" for x, n in runs) or "(empty)"


def _letter(layout: object, item: object) -> str:
    if isinstance(item, str) and item in KINDS:
        return item
    if isinstance(item, str) and item.strip().lower() in _LETTER:
        return _LETTER[item.strip().lower()]
    _fail(
        layout,
        f"{item!r} is not a layer: one of {sorted(KINDS)} or {sorted(_LETTER)}",
        "name each layer with a letter or Megatron's layer-type name",
    )
    raise AssertionError  # unreachable: _fail raises
