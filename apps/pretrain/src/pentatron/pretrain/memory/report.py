"""Per-stage memory report: rows, the rich table, JSON, and the stacked bar chart.

One row per pipeline stage, for one rank of that stage (tp and ep ranks of a stage hold the
same shapes; dp rank 0 of the distributed optimizer, whose shard differs from the others by
at most the padding of a bucket).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .activations import fp8_weight_copies, korthikanti_per_layer, stage_activations
from .fsdp2 import gathered_bytes, staging_bytes
from .plan import MemoryPlan
from .static import chunk_layers, static_bytes
from .zero_bubble import is_zero_bubble, peaks

GIB = 1024**3


@dataclass
class StageMemory:
    stage: int
    num_parameters: int
    weights_bytes: int
    grads_bytes: int
    main_params_bytes: int
    optimizer_bytes: int
    fp8_weight_cache_bytes: int  # TE's cached FP8 weight copies (one per TE-linear weight)
    fsdp_gathered_bytes: int  # FSDP2: params gathered for compute, their unsharded grads
    wgrad_store_bytes: int  # zero-bubble: pending W's at the peak with the activations
    activations_bytes: int
    comm_buffers_bytes: int
    total_bytes: int
    microbatches_in_flight: float
    activations_per_microbatch: dict[str, int] = field(default_factory=dict)
    korthikanti_activations_bytes: int = 0
    headroom_bytes: int | None = None


def _comm_buffers(plan: MemoryPlan, pp_rank: int) -> int:
    """p2p: one received and one sent activation `e s' b h` per pipeline direction; SP: the
    all-gathered `[s, b, h]` input of a column-parallel linear (transient, one at a time);
    FSDP2: a unit's flat all-gather output and reduce-scatter input (`fsdp2.staging_bytes`)."""
    c, e, b = plan.config, plan.param_bytes, plan.micro_batch_size
    s = plan.seq_length // plan.cp
    s_ = s // plan.tp if c.sequence_parallel else s
    out = 4 * e * s_ * b * c.hidden_size if plan.pp > 1 else 0
    if c.sequence_parallel:
        out += e * s * b * c.hidden_size
    return out + staging_bytes(plan, pp_rank)


def korthikanti_stage(plan: MemoryPlan, pp_rank: int) -> int:
    """The textbook activations of a stage: its layers x Korthikanti's per-layer bytes x
    the micro-batches in flight."""
    c = plan.config
    layers = sum(len(chunk_layers(plan, pp_rank, vp)) for vp in range(plan.vpp))
    per = korthikanti_per_layer(
        plan.seq_length // plan.cp,
        plan.micro_batch_size,
        c.hidden_size,
        c.num_attention_heads,
        plan.tp,
        c.sequence_parallel,
        c.recompute_granularity,
    )
    return int(layers * per * stage_activations(plan, pp_rank).in_flight)


def stage_memory(plan: MemoryPlan, pp_rank: int, device_bytes: int | None = None) -> StageMemory:
    st = static_bytes(plan, pp_rank)
    act = stage_activations(plan, pp_rank)
    fp8 = fp8_weight_copies(plan, pp_rank)  # cached once per step, not per micro-batch
    comm = _comm_buffers(plan, pp_rank)
    gathered = gathered_bytes(plan, pp_rank)
    store = peaks(plan, pp_rank)[1] - act.peak_bytes if is_zero_bubble(plan) else 0
    total = (
        gathered
        + store
        + st.weights_bytes
        + st.grads_bytes
        + st.main_params_bytes
        + st.optimizer_bytes
        + fp8
        + act.peak_bytes
        + comm
    )
    return StageMemory(
        stage=pp_rank,
        num_parameters=st.num_parameters,
        weights_bytes=st.weights_bytes,
        grads_bytes=st.grads_bytes,
        main_params_bytes=st.main_params_bytes,
        optimizer_bytes=st.optimizer_bytes,
        fp8_weight_cache_bytes=fp8,
        fsdp_gathered_bytes=gathered,
        wgrad_store_bytes=store,
        activations_bytes=act.peak_bytes,
        comm_buffers_bytes=comm,
        total_bytes=total,
        microbatches_in_flight=act.in_flight,
        activations_per_microbatch=asdict(act.per_microbatch),
        korthikanti_activations_bytes=korthikanti_stage(plan, pp_rank),
        headroom_bytes=None if device_bytes is None else device_bytes - total,
    )


def memory_report(plan: MemoryPlan, device_memory_gb: float | None = None) -> list[StageMemory]:
    """One `StageMemory` per pipeline stage."""
    dev = None if device_memory_gb is None else int(device_memory_gb * GIB)
    return [stage_memory(plan, r, dev) for r in range(plan.pp)]


COLUMNS = (
    ("weights", "weights_bytes"),
    ("grads", "grads_bytes"),
    ("main fp32", "main_params_bytes"),
    ("optimizer", "optimizer_bytes"),
    ("fp8 weights", "fp8_weight_cache_bytes"),
    ("fsdp gathered", "fsdp_gathered_bytes"),
    ("W store", "wgrad_store_bytes"),
    ("activations", "activations_bytes"),
    ("comm", "comm_buffers_bytes"),
)


def print_table(plan: MemoryPlan, stages: list[StageMemory]) -> None:
    """A rich table (GiB = 2^30 bytes, per rank) with the activations per micro-batch."""
    from rich.console import Console
    from rich.table import Table

    title = (
        f"{plan.name}: tp={plan.tp} pp={plan.pp} vpp={plan.vpp} dp={plan.dp} cp={plan.cp} "
        f"ep={plan.ep} m={plan.num_microbatches}; GiB (2^30 bytes) per rank; headroom = "
        "--device-memory-gb (GiB) - total"
    )
    t = Table(title=title)
    for col in ("stage", "params", *(c for c, _ in COLUMNS), "in flight", "total", "headroom"):
        t.add_column(col, justify="right")
    for s in stages:
        head = "-" if s.headroom_bytes is None else f"{s.headroom_bytes / GIB:.2f}"
        t.add_row(
            str(s.stage),
            f"{s.num_parameters / 1e9:.3f}B",
            *(f"{getattr(s, k) / GIB:.2f}" for _, k in COLUMNS),
            f"{s.microbatches_in_flight:g}",
            f"{s.total_bytes / GIB:.2f}",
            head,
        )
    console = Console()
    console.print(t)
    b = Table(title="activations per micro-batch, by module (GiB, all chunks of the stage)")
    keys = list(stages[0].activations_per_microbatch)
    b.add_column("stage", justify="right")
    for k in keys:
        b.add_column(k.replace("_", " "), justify="right")
    b.add_column("Korthikanti peak", justify="right")
    for s in stages:
        b.add_row(
            str(s.stage),
            *(f"{s.activations_per_microbatch[k] / GIB:.3f}" for k in keys),
            f"{s.korthikanti_activations_bytes / GIB:.2f}",
        )
    console.print(b)


def plot(plan: MemoryPlan, stages: list[StageMemory], path: str) -> None:
    """A stacked bar per stage of the terms in COLUMNS (GiB), saved to `path`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib; fix: pip install 'pentatron-pretrain[plot]'"
        ) from None
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    x = [s.stage for s in stages]
    bottom = [0.0] * len(stages)
    for label, key in COLUMNS:
        vals = [getattr(s, key) / GIB for s in stages]
        if any(vals):
            ax.bar(x, vals, bottom=bottom, label=label)
            bottom = [a + v for a, v in zip(bottom, vals)]
    if stages[0].headroom_bytes is not None:
        cap = (stages[0].total_bytes + stages[0].headroom_bytes) / GIB
        ax.axhline(cap, color="k", linestyle="--", linewidth=1, label="device memory")
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("GiB per rank")
    ax.set_xticks(x)
    ax.set_title(f"{plan.name}: tp{plan.tp} pp{plan.pp} vpp{plan.vpp} dp{plan.dp}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
