"""Zero-bubble schedules (`--pipeline-schedule zb-h1 | zbv`): the weight-gradient store
and the peak it adds to the saved activations, per rank.

A micro-batch's B queues its W (tp-layers' `WeightGradStore`); until the schedule runs
that W the store holds, per deferred weight (what each item's `nbytes` counts):
- a parallel linear: its input (the `[s/t, b, in]` shard under sequence parallelism, which
  W gathers again) and its output gradient: column-parallel (qkv, fc1, the output layer)
  `e (s' in + s out/t) b`, row-parallel (proj, fc2) `e (s in/t + s out) b` (its output
  gradient is the partial sum's, `[s, b, h]`, before sequence parallelism's reduce-scatter);
- a norm: its input, its output gradient and its fp32 statistics (rstd; LayerNorm's mean
  too): `2 e s' b h + 4 s' b` (8 with LayerNorm);
- the word embedding: the int64 ids `8 b s` and its output gradient `e b s h`.
The peak: the rank's F, B and W in the schedule's own order (`zb_h1_rank_schedule`,
`zbv_schedules`), sampled before each op, of the saved activations of the forwards
whose B has not run plus the W's not yet run (`measure` samples the same moments).
Sized for the dense local spec; MoE, multi-latent attention, q/k norms, gpt-oss's sinks
and MTP defer other weights and are refused by `check_sized`.
"""

from __future__ import annotations

from pentatron.pipeline import zb_h1_rank_schedule, zbv_schedules

from .activations import chunk_activations
from .plan import MemoryPlan, MemoryPlanError
from .static import chunk_parameters, is_last_chunk

_COLUMN = (".linear_qkv.weight", ".linear_fc1.weight", "output_layer.weight")
_ROW = (".linear_proj.weight", ".linear_fc2.weight")
_NORMS = ("_layernorm.weight",)
_AUTOGRAD = ("_layernorm.bias", ".bias", "embedding.position_embeddings.weight")


def is_zero_bubble(plan: MemoryPlan) -> bool:
    return plan.pipeline_schedule in ("zb-h1", "zbv")


def check_sized(plan: MemoryPlan) -> None:
    """Refuse what the store's sizing does not cover (before any sizing)."""
    c = plan.config
    unsized = [
        ("--num-experts", c.num_moe_experts),
        ("--multi-latent-attention", c.multi_latent_attention),
        ("--qk-layernorm", c.qk_layernorm),
        ("--softmax-type", c.softmax_type if c.softmax_type != "vanilla" else None),
        ("--mtp-num-layers", c.mtp_num_layers),
    ]
    for flag, value in unsized:
        if value:
            raise MemoryPlanError(
                f"{flag} with --pipeline-schedule {plan.pipeline_schedule}: the weight-gradient "
                "store is sized for the dense local spec only; fix: size the run with 1f1b "
                "(the same activations) and add the store, or measure it with torchrun -m "
                "pentatron.pretrain.memory.measure"
            )


def wgrad_bytes(plan: MemoryPlan, pp_rank: int, vp: int) -> int:
    """Bytes one micro-batch's W of chunk `vp` holds while pending."""
    c, t, b, e = plan.config, plan.tp, plan.micro_batch_size, plan.param_bytes
    s = plan.seq_length // plan.cp
    s_ = s // t if c.sequence_parallel else s
    h = c.hidden_size
    params = chunk_parameters(plan, pp_rank, vp)
    names = {p.name for p in params}
    if is_last_chunk(plan, pp_rank, vp) and "output_layer.weight" not in names:
        # tied on this stage: the output layer multiplies by the embedding's table
        out = e * (s_ * h + s * plan.padded_vocab_size // t) * b
    else:
        out = 0
    stats = 4 if c.normalization == "RMSNorm" else 8
    for p in params:
        rows, cols = p.dim0, p.numel // p.dim0
        if p.name.endswith(_COLUMN):
            out += e * (s_ * cols + s * rows) * b
        elif p.name.endswith(_ROW):  # its output is the partial sum, reduced after it
            out += e * (s * cols + s * rows) * b
        elif p.name.endswith(_NORMS):
            out += 2 * e * s_ * b * h + stats * s_ * b
        elif p.name == "embedding.word_embeddings.weight":
            out += 8 * b * s + e * b * s * h
        elif not p.name.endswith(_AUTOGRAD):
            raise MemoryPlanError(f"{p.name}: no weight-gradient sizing for it (internal)")
    return out


def _ops(plan: MemoryPlan, pp_rank: int) -> list:
    m = plan.num_microbatches
    if plan.pipeline_schedule == "zbv":
        return zbv_schedules(plan.pp, m)[pp_rank]
    return zb_h1_rank_schedule(plan.pp, pp_rank, m)


def peaks(plan: MemoryPlan, pp_rank: int) -> tuple[int, int]:
    """(saved activations at their peak, saved activations plus pending W's at theirs)
    along the rank's schedule, sampled before each op and at the end."""
    check_sized(plan)
    act = [chunk_activations(plan, pp_rank, vp).total for vp in range(plan.vpp)]
    wgrad = [wgrad_bytes(plan, pp_rank, vp) for vp in range(plan.vpp)]
    live = pending = peak_act = peak_all = 0
    for op in [*_ops(plan, pp_rank), None]:
        peak_act, peak_all = max(peak_act, live), max(peak_all, live + pending)
        if op is None:
            break
        if op.kind == "F":
            live += act[op.chunk]
        elif op.kind == "B":
            live, pending = live - act[op.chunk], pending + wgrad[op.chunk]
        else:
            pending -= wgrad[op.chunk]
    return peak_act, peak_all
