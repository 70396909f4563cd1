"""FSDP2's gathered state per rank: the params all-gathered for compute and their
unsharded grads, held beside the sharded static terms (`static._fsdp2_bytes`).

Units: each transformer layer of a chunk (`decoder.layers.i`) and the chunk's root (every
other param: embeddings, final norm, output layer, MTP). A gathered param takes
d ceil(rows / d) rows (its padded shards) in the compute dtype; its unsharded grad its own
shape in the compute dtype until the unit's reduce-scatter. Measured by
`measure.MeasuredMemory.fsdp_gathered_peak_bytes`, the largest sum at once:
- the roots stay gathered from their chunk's first forward to its backward's end
  (reshard_after_forward=False): every chunk's root, the pipeline's micro-batches in
  flight keeping them gathered in between;
- in backward a layer is gathered again while the next one back is prefetched (FSDP2's
  backward prefetch), and its grads are all held just before its reduce-scatter: two
  layers and one layer's grads, with the root grads already complete (final norm, output
  layer, MTP: used after the decoder in forward);
- without reshard after forward (`--data-parallel-sharding-strategy optim_grads`) every
  layer stays gathered from forward to backward: all of them and one layer's grads;
- at the chunk's end every root grad (the embedding's last), the layers freed.
Not counted (inside FSDP2's hooks, like the other comm buffers): a unit's flat all-gather
output while it is copied out and its reduce-scatter's input (`comm_bytes`).
"""

from __future__ import annotations

from .plan import MemoryPlan
from .static import ParamSpec, chunk_parameters

# root params whose grads are complete before the decoder's backward starts
_EARLY = ("decoder.final_layernorm.", "output_layer.", "mtp.")


def _gathered(plan: MemoryPlan, params: list[ParamSpec]) -> int:
    d = plan.dp * plan.cp
    return sum(-(-p.dim0 // d) * d * (p.numel // p.dim0) for p in params)


def _units(plan: MemoryPlan, pp_rank: int, vp: int) -> tuple[list[ParamSpec], list[list]]:
    root: list[ParamSpec] = []
    layers: dict[str, list[ParamSpec]] = {}
    for p in chunk_parameters(plan, pp_rank, vp):
        if p.name.startswith("decoder.layers."):
            layers.setdefault(p.name.split(".")[2], []).append(p)
        else:
            root.append(p)
    return root, list(layers.values())


def gathered_bytes(plan: MemoryPlan, pp_rank: int) -> int:
    """The most bytes of gathered params and unsharded grads a rank of stage `pp_rank`
    holds at once (0 without FSDP2)."""
    if not plan.use_torch_fsdp2:
        return 0
    e = plan.param_bytes  # the compute dtype's
    roots, worst = 0, 0
    for vp in range(plan.vpp):
        root, layers = _units(plan, pp_rank, vp)
        roots += _gathered(plan, root)
        early = sum(p.numel for p in root if p.name.startswith(_EARLY))
        sizes = [_gathered(plan, layer) for layer in layers]
        grads = [sum(p.numel for p in layer) for layer in layers]
        if not layers:
            blocks = 0
        elif plan.fsdp_reshard_after_forward:  # layer i, its prefetched i-1, i's grads
            blocks = max(
                sizes[i] + (sizes[i - 1] if i else 0) + grads[i] for i in range(len(layers))
            )
        else:
            blocks = sum(sizes) + max(grads)
        worst = max(worst, blocks + early, sum(p.numel for p in root))
    return e * (roots + worst)


def staging_bytes(plan: MemoryPlan, pp_rank: int) -> int:
    """FSDP2's transient buffers of its largest unit (not measured: they live inside its
    hooks): the flat all-gather output, held while copied out to the params' buffers
    (compute dtype), and the reduce-scatter's input, the unit's grads padded (reduce dtype).
    0 without FSDP2."""
    if not plan.use_torch_fsdp2:
        return 0
    largest = 0
    for vp in range(plan.vpp):
        root, layers = _units(plan, pp_rank, vp)
        largest = max([largest, _gathered(plan, root), *(_gathered(plan, u) for u in layers)])
    return largest * (plan.param_bytes + plan.fsdp_reduce_bytes)
