"""Where a tp shard of a GPT parameter lies in the global (tp=1) tensor.

A checkpoint stores every parameter (and its per-element optimizer state) as its global
tensor under its global name (`decoder.layers.{layer_offset + i}...`). A tp shard is one
or two rectangles of it (see `pentatron.models.sharding` for the split rules):

| split (param_sharding) | local shard                  | rectangles in the global tensor       |
|------------------------|------------------------------|---------------------------------------|
| replicated             | `[n, ...]`                   | the whole tensor (tp rank 0 writes)   |
| dim d, stride 1        | `[.., n_d/t, ..]`            | offset `r n_d/t` on dim d             |
| swiglu fc1 (stride 2)  | `[2f/t, h]` = `[gate; up]`   | `<name>/gate`, `<name>/up` `[f, h]`,  |
|                        |                              | each at row `r f/t`                   |
| vocab (dim 0, padded)  | `[V_pad/t, h]`               | real rows: global `[V, h]`; padding   |
|                        |                              | rows: `<name>/vocab_padding`          |
|                        |                              | `[V_pad - V, h]`                      |

| expert `[E/ep, ...]`   | ep rank e, etp split as above | offset `e E/ep` on dim 0, then the   |
|                        |                              | etp split like tp (gate/up for fc1)  |

With FSDP2 (`--use-torch-fsdp2`) a rank holds only rows `[lo, hi)` of dim 0 of its tp shard
(torch.chunk's cut over dp x cp); `restrict_rows` keeps the part of each rectangle that
falls there, and every dp rank writes its own rows.

The tied `output_layer.weight` of the last stage (pp > 1) is a copy of the embedding: it
maps to the embedding's rectangles and is never written. So is the last stage's embedding
with multi-token prediction at pp > 1 (a copy of the first stage's, under the same names). Who writes a rectangle: dense
tensors dp rank 0 (and tp rank 0 if replicated over tp), expert tensors edp rank 0 (and
etp rank 0 if replicated over etp): exactly one writer per value.
"""

from __future__ import annotations

from dataclasses import dataclass

from pentatron.models import TransformerConfig, global_param_name, param_sharding
from pentatron.optim import FSDP2DataParallel

EMBEDDING = "embedding.word_embeddings.weight"
# The rows a vocabulary is padded with (to a multiple of --make-vocab-size-divisible-by x
# tp) train like the others in the output layer (their logits enter the softmax), so a
# resume must restore them; their number changes with tp, so they live apart from the real
# rows and load only where the padded size is the saved one (else they start at zero).
VOCAB_PADDING = "/vocab_padding"


@dataclass(frozen=True)
class Rect:
    """One rectangle: `local` (slices into the tp shard) is stored in `key` at `offsets`."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local: tuple[slice, ...]
    writer: bool  # False: another rank writes the same values (replica or tied copy)


@dataclass(frozen=True)
class ShardInfo:
    """What `param_rects` needs to know about a chunk and the tp layout."""

    config: TransformerConfig
    layer_offset: int
    tp_rank: int
    tp_size: int
    vocab_size: int
    padded_vocab_size: int
    tied_output: bool  # `output_layer.weight` is the embedding's copy
    dp_writer: bool = True  # dp rank 0: writes the dense tensors of its tp shard
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    edp_writer: bool = True  # edp rank 0: writes the expert tensors of its (ep, etp) shard
    embedding_copy: bool = False  # `embedding.*` is the first stage's copy (MTP, pp > 1)


def _split(key, shape, dim, rank, size, start, stop, writer) -> Rect:
    """The rows `[start, stop)` of dim `dim` of a shard, at global offset `rank * size`."""
    local = [slice(None)] * len(shape)
    local[dim] = slice(start, stop)
    gshape = list(shape)
    gshape[dim] = (stop - start) * size
    offsets = [0] * len(shape)
    offsets[dim] = rank * (stop - start)
    return Rect(key, tuple(gshape), tuple(offsets), tuple(local), writer)


def _vocab_rect(key: str, shape: tuple[int, ...], info: ShardInfo, writer: bool) -> list[Rect]:
    """The shard's real rows in `key` `[V, ...]`, its padding rows in `key/vocab_padding`."""
    rows = info.padded_vocab_size // info.tp_size
    start = info.tp_rank * rows
    real = max(0, min(info.vocab_size, start + rows) - start)  # 0: the shard is all padding
    rest = (slice(None),) * (len(shape) - 1)
    zeros = (0,) * (len(shape) - 1)
    out = []
    if real:
        gshape = (info.vocab_size, *shape[1:])
        out.append(Rect(key, gshape, (start, *zeros), (slice(0, real), *rest), writer))
    if real < rows:
        gshape = (info.padded_vocab_size - info.vocab_size, *shape[1:])
        offsets = (start + real - info.vocab_size, *zeros)
        out.append(Rect(key + VOCAB_PADDING, gshape, offsets, (slice(real, rows), *rest), writer))
    return out


def param_rects(local_name: str, shape: tuple[int, ...], info: ShardInfo) -> list[Rect]:
    """The rectangles of one local param of shard shape `shape` (see the module table)."""
    name = global_param_name(local_name, info.layer_offset)
    writer = info.dp_writer
    if name == "output_layer.weight" and info.tied_output:
        name, writer = EMBEDDING, False
    if info.embedding_copy and name.startswith("embedding."):
        writer = False
    rule = param_sharding(name, info.config)
    if rule.vocab:
        return _vocab_rect(name, shape, info, writer)
    if rule.expert:
        rects = _tp_rects(name, shape, rule, info.etp_rank, info.etp_size, info.edp_writer)
        return [_on_expert_rank(rect, info) for rect in rects]
    return _tp_rects(name, shape, rule, info.tp_rank, info.tp_size, writer)


def _tp_rects(name, shape, rule, r: int, t: int, writer: bool) -> list[Rect]:
    """Rectangles of a shard split over `t` ranks (rank `r`) by `rule` (dim, stride)."""
    if rule.dim is None:
        full = tuple(slice(None) for _ in shape)
        return [Rect(name, shape, (0,) * len(shape), full, writer and r == 0)]
    n = shape[rule.dim]
    if rule.stride == 1:
        return [_split(name, shape, rule.dim, r, t, 0, n, writer)]
    if rule.stride != 2:
        raise NotImplementedError(f"{name}: stride {rule.stride} on dim {rule.dim}")
    half = n // 2
    return [
        _split(f"{name}/gate", shape, rule.dim, r, t, 0, half, writer),
        _split(f"{name}/up", shape, rule.dim, r, t, half, n, writer),
    ]


def _on_expert_rank(rect: Rect, info: ShardInfo) -> Rect:
    """Place an expert shard's rectangle among all experts: dim 0 grows by ep."""
    local_experts = rect.global_shape[0]
    gshape = (local_experts * info.ep_size, *rect.global_shape[1:])
    offsets = (info.ep_rank * local_experts, *rect.offsets[1:])
    return Rect(rect.key, gshape, offsets, rect.local, rect.writer)


def restrict_rows(rect: Rect, lo: int, hi: int) -> Rect | None:
    """The part of `rect` inside rows `[lo, hi)` of the shard's dim 0, with `local` relative
    to row `lo` (the shard's rows this rank holds); None if they do not meet."""
    first = rect.local[0]
    start = first.start or 0
    stop = first.stop if first.stop is not None else hi
    a, b = max(start, lo), min(stop, hi)
    if a >= b:
        return None
    local = (slice(a - lo, b - lo), *rect.local[1:])
    offsets = (rect.offsets[0] + a - start, *rect.offsets[1:])
    return Rect(rect.key, rect.global_shape, offsets, local, rect.writer)


def shard_info(chunk, tp_rank: int, tp_size: int, grid=None) -> ShardInfo:
    """`ShardInfo` of a GPTModel chunk (or a DDP wrapper of one); `grid` gives the ep/etp
    position and which dp / edp rank writes (None: one process, it writes everything)."""
    model = getattr(chunk, "module", chunk)
    expert = {}
    if grid is not None:
        fsdp2 = isinstance(chunk, FSDP2DataParallel)  # each dp rank holds other rows
        expert = dict(
            dp_writer=fsdp2 or grid.rank("dp") == 0,
            ep_rank=grid.rank("ep"),
            ep_size=grid.size("ep"),
            etp_rank=grid.rank("etp"),
            etp_size=grid.size("etp"),
            edp_writer=fsdp2 or grid.rank("edp") == 0,
        )
    return ShardInfo(
        **expert,
        config=model.config,
        layer_offset=model.layer_offset,
        tp_rank=tp_rank,
        tp_size=tp_size,
        vocab_size=model.vocab_size,
        padded_vocab_size=model.padded_vocab_size,
        tied_output=bool(model.share_embeddings_and_output_weights),
        embedding_copy=bool(getattr(model, "mtp_process", False)) and not model.pre_process,
    )
