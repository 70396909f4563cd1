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
  layer: used after the decoder in forward; MTP's too, a layout not measured); experts split over ep are units of their
  own over edp, nested in their layer's (see `_layers_term`);
- without reshard after forward (`--data-parallel-sharding-strategy optim_grads`) every
  layer stays gathered from forward to backward: all of them and one layer's grads;
- at the chunk's end every root grad (the embedding's last), the layers freed.
Not counted (inside FSDP2's hooks, like the other comm buffers): a unit's flat all-gather
output while it is copied out and its reduce-scatter's input (`staging_bytes`).
"""

from __future__ import annotations

from .plan import MemoryPlan
from .static import ParamSpec, chunk_parameters, fsdp2_on_edp, fsdp2_shards

# root params whose grads are complete before the decoder's backward starts
_EARLY = ("decoder.final_layernorm.", "output_layer.", "mtp.")


def _gathered(plan: MemoryPlan, params: list[ParamSpec]) -> int:
    total = 0
    for p in params:
        d = fsdp2_shards(plan, p)
        total += -(-p.dim0 // d) * d * (p.numel // p.dim0)
    return total


def _units(plan: MemoryPlan, pp_rank: int, vp: int) -> tuple[list[ParamSpec], list, list]:
    """(root params, each layer's params in its own unit, each layer's nested expert unit:
    its experts when they are split over ep, else empty)."""
    root: list[ParamSpec] = []
    layers: dict[str, list[ParamSpec]] = {}
    experts: dict[str, list[ParamSpec]] = {}
    for p in chunk_parameters(plan, pp_rank, vp):
        if p.name.startswith("decoder.layers."):
            i = p.name.split(".")[2]
            layers.setdefault(i, [])
            experts.setdefault(i, [])
            (experts if fsdp2_on_edp(plan, p) else layers)[i].append(p)
        else:
            root.append(p)
    return root, list(layers.values()), list(experts.values())


def _layers_term(plan: MemoryPlan, layers: list, experts: list) -> int:
    """The layers' part of the peak, in elements. In backward each unit prefetches the one
    before it in forward's order of unit ends (a layer's nested experts end before it): a
    layer's own unit prefetches its experts, its experts the previous layer's own unit. So
    while layer i's expert grads are complete (before their reduce-scatter) its own unit,
    its experts and layer i - 1's own unit are gathered; then its own grads with its own
    unit and layer i - 1's. Without reshard after forward every unit up to i is gathered."""
    dense = [_gathered(plan, u) for u in layers]
    routed = [_gathered(plan, u) for u in experts]
    g_dense = [sum(p.numel for p in u) for u in layers]
    g_routed = [sum(p.numel for p in u) for u in experts]
    worst = 0
    for i in range(len(layers)):
        prev = dense[i - 1] if i else 0
        if plan.fsdp_reshard_after_forward:
            held = [dense[i] + prev + g_dense[i]]
            if experts[i]:
                held.append(dense[i] + routed[i] + prev + g_routed[i])
        else:
            upto = sum(dense[: i + 1]) + sum(routed[: i + 1])
            held = [upto + g_dense[i], upto + g_routed[i]]
        worst = max(worst, *held)
    return worst


def gathered_bytes(plan: MemoryPlan, pp_rank: int) -> int:
    """The most bytes of gathered params and unsharded grads a rank of stage `pp_rank`
    holds at once (0 without FSDP2)."""
    if not plan.use_torch_fsdp2:
        return 0
    roots, worst = 0, 0
    for vp in range(plan.vpp):
        root, layers, experts = _units(plan, pp_rank, vp)
        roots += _gathered(plan, root)
        early = sum(p.numel for p in root if p.name.startswith(_EARLY))
        blocks = _layers_term(plan, layers, experts) if layers else 0
        worst = max(worst, blocks + early, sum(p.numel for p in root))
    return plan.param_bytes * (roots + worst)


def staging_bytes(plan: MemoryPlan, pp_rank: int) -> int:
    """FSDP2's transient buffers of its largest unit (not measured: they live inside its
    hooks): the flat all-gather output, held while copied out to the params' buffers
    (compute dtype), and the reduce-scatter's input, the unit's grads padded (reduce dtype).
    0 without FSDP2."""
    if not plan.use_torch_fsdp2:
        return 0
    largest = 0
    for vp in range(plan.vpp):
        root, layers, experts = _units(plan, pp_rank, vp)
        units = [root, *layers, *(u for u in experts if u)]
        largest = max([largest, *(_gathered(plan, u) for u in units)])
    return largest * (plan.param_bytes + plan.fsdp_reduce_bytes)
