"""Communication volume per step and rank: the comm ledger vs closed forms written here.

    python benchmarks/comm_volume.py

Each case runs a tiny model on gloo ranks (the parallel-state harness), records every
collective with `pentatron.parallel_state.comm.trace()`, and divides the payload elements
per rank and op by a closed form derived from the model shapes below. Every ratio must be
exactly 1: the formulas are what Megatron-LM moves, so a drift means our code sends more
(or less) than it should. Counts, not seconds: the result is the same on any machine.

Symbols: s sequence length, b micro-batch size, h hidden size, L layers, t tp size,
p pp size, v virtual stages per rank, m micro-batches, d dp size, N parameters.

This module imports nothing from benchmarks/ so the harness can load it by file path in the
worker processes; the rank functions take and return plain picklable values.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

# Shapes of the tiny cases: multiples of 64 so no layer splits unevenly.
S, B, H, HEADS, FFN, LAYERS = 16, 2, 64, 4, 256, 2


def _per_op(ledger: Any, group: str | None) -> dict[str, list[int]]:
    """{op: [calls, payload elements]} of this rank's records over `group` (None: any)."""
    out: dict[str, list[int]] = {}
    for r in ledger.records:
        if group is None or r.group == group:
            entry = out.setdefault(r.op, [0, 0])
            entry[0] += 1
            entry[1] += r.elements
    return out


# --- TP and SP: the collectives inside transformer layers ---------------------------------
def theory_tp(s: int, b: int, h: int, layers: int, t: int, sp: bool) -> dict[str, int]:
    """Payload elements per rank and op for one forward + backward of `layers` layers.

    Without SP (Megatron's f/g): each layer has two row-parallel outputs (attention proj,
    fc2), each all-reduced in forward, and two column-parallel inputs (qkv, fc1), each
    all-reduced in backward: 4 all-reduces of [s, b, h] per layer.
    With SP: forward all-gathers [s/t, b, h] before qkv and fc1 (2) and reduce-scatters
    [s, b, h] after proj and fc2 (2); backward re-gathers the saved [s/t, b, h] input of qkv
    and fc1 for the weight grads (2, Megatron's memory saving), reduce-scatters their
    [s, b, h] input grads (2), and all-gathers the [s/t, b, h] grads of proj and fc2 (2):
    6 all-gathers of s/t*b*h and 4 reduce-scatters of s*b*h per layer.
    """
    if not sp:
        return {"all_reduce": 4 * layers * s * b * h}
    return {"all_gather": 6 * layers * (s // t) * b * h, "reduce_scatter": 4 * layers * s * b * h}


def tp_rank(sp: bool) -> dict[str, list[int]]:
    """One fwd+bwd of a `LAYERS`-layer TransformerBlock at tp = world size."""
    from pentatron.models import TransformerBlock, TransformerConfig, get_gpt_layer_local_spec
    from pentatron.parallel_state import (
        ParallelConfig,
        comm,
        destroy_model_parallel,
        initialize_model_parallel,
    )

    t = dist.get_world_size()
    grid = initialize_model_parallel(ParallelConfig(tp=t))
    try:
        config = TransformerConfig(
            num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
            attention_dropout=0.0, hidden_dropout=0.0, sequence_parallel=sp,
            tensor_model_parallel_size=t,
        )  # fmt: skip
        block = TransformerBlock(
            config,
            get_gpt_layer_local_spec(),
            post_layer_norm=False,
            tp_group=grid.group("tp"),
            tp_size=t,
        )
        x = torch.randn(S // t if sp else S, B, H, requires_grad=True)
        with comm.trace() as ledger:
            block(x).sum().backward()
        return _per_op(ledger, "tp")
    finally:
        destroy_model_parallel(grid)


# --- PP: activations and their grads between stages ----------------------------------------
def theory_pp(s: int, b: int, h: int, p: int, v: int, m: int, rank: int) -> dict[str, int]:
    """Elements rank `rank` sends and receives in one step of m micro-batches.

    Virtual stage k = c*p + r (chunk c on rank r), p*v stages in all. Each micro-batch
    crosses every boundary once forward (activation [s, b, h]) and once backward (its grad,
    same shape). Rank r owns v stages; it sends a forward output from each that is not the
    last stage (v - [r = p-1]) and a grad from each that is not the first (v - [r = 0]),
    and receives the same counts mirrored: per rank
    send = recv = m*s*b*h*(2v - [r = 0] - [r = p-1]); over all ranks 2*m*(p*v - 1)*s*b*h.
    """
    per = m * s * b * h * (2 * v - (rank == 0) - (rank == p - 1))
    return {"send": per, "recv": per}


class _Chunk(torch.nn.Module):
    """Residual tanh blocks on [s, b, h]; the first stage reads data, later ones p2p."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(H, H)
        self.first, self.input_tensor = first, None

    def set_input_tensor(self, tensors: list) -> None:
        self.input_tensor = tensors[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.first else self.input_tensor
        return h + torch.tanh(self.fc(h))


def _pp_forward_step(it: Any, model: _Chunk) -> tuple[torch.Tensor, Any]:
    x = next(it)
    out = model(x)
    return out, lambda y: (y.pow(2).mean(), y.pow(2).mean().detach())


def pp_rank(vpp: int | None, m: int) -> dict[str, list[int]]:
    """One 1F1B (vpp None) or interleaved step of m micro-batches at pp = world size."""
    from pentatron.parallel_state import (
        ParallelConfig,
        comm,
        destroy_model_parallel,
        initialize_model_parallel,
    )
    from pentatron.pipeline import PipelineConfig, get_forward_backward_func

    p, v = dist.get_world_size(), vpp or 1
    grid = initialize_model_parallel(ParallelConfig(pp=p, vpp=vpp))
    try:
        rank = grid.rank("pp")
        chunks = [_Chunk(first=(rank == 0 and c == 0)) for c in range(v)]
        data = [torch.randn(S, B, H) for _ in range(m)]
        func = get_forward_backward_func(p, vpp)
        with comm.trace() as ledger:
            func(
                forward_step_func=_pp_forward_step,
                data_iterator=[iter(data) for _ in range(v)],
                model=chunks if vpp else chunks[0],
                num_microbatches=m,
                seq_length=S,
                micro_batch_size=B,
                config=PipelineConfig(hidden_size=H),
                grid=grid,
            )
        # Only p2p sends/receives here; by op, not group name: when the pp group spans
        # the whole world the ledger may name it "world".
        out = _per_op(ledger, None)
        out["rank"] = [rank, 0]
        return out
    finally:
        destroy_model_parallel(grid)


# --- DP and ZeRO-1: the grad buffer's collectives ------------------------------------------
def mlp_numels(h: int = H, ffn: int = FFN) -> list[int]:
    """Parameter sizes of the DP case's model: Linear(h, ffn) -> GeLU -> Linear(ffn, h)."""
    return [ffn * h, ffn, h * ffn, h]


def theory_dp(numels: list[int], d: int, distributed_optimizer: bool) -> dict[str, int]:
    """Payload elements per rank of one step's grad sync (+ param sync with ZeRO-1).

    One bucket holds every grad. Plain DDP all-reduces it as is: N elements. The
    distributed optimizer lays each param on a 64-element boundary and pads the bucket to
    a multiple of lcm(d, 128) (so each rank owns an equal shard): Np elements; it
    reduce-scatters the Np grads and, after the step, all-gathers this rank's Np/d params.
    Wire bytes of the pair equal one all-reduce of Np (2(d-1)/d * Np). With sharded grads
    the global grad norm (computed every step, for clipping and logging) needs one more
    all-reduce over dp of a single fp32 scalar.
    """
    if not distributed_optimizer:
        return {"all_reduce": sum(numels)}
    offset = 0
    for n in reversed(numels):  # the buffer holds params in reverse order
        offset = -(-offset // 64) * 64 + n
    padded = -(-offset // math.lcm(d, 128)) * math.lcm(d, 128)
    return {"reduce_scatter": padded, "all_gather": padded // d, "all_reduce": 1}


def dp_rank(distributed_optimizer: bool) -> dict[str, list[int]]:
    """One fwd + bwd + grad sync + optimizer step + param sync at dp = world size."""
    from pentatron.optim import DDPConfig, DistributedDataParallel, OptimizerConfig, get_optimizer
    from pentatron.parallel_state import (
        ParallelConfig,
        comm,
        destroy_model_parallel,
        initialize_model_parallel,
    )

    grid = initialize_model_parallel(ParallelConfig())
    try:
        torch.manual_seed(0)
        module = torch.nn.Sequential(
            torch.nn.Linear(H, FFN), torch.nn.GELU(), torch.nn.Linear(FFN, H)
        )
        ddp = DistributedDataParallel(
            DDPConfig(use_distributed_optimizer=distributed_optimizer), module, grid=grid
        )
        opt = get_optimizer(
            OptimizerConfig(
                lr=1e-3, clip_grad=0.0, use_distributed_optimizer=distributed_optimizer
            ),
            [ddp],
            grid=grid,
        )
        x = torch.randn(S * B, H)
        with comm.trace() as ledger:
            ddp.zero_grad_buffer()
            ddp(x).pow(2).mean().backward()
            ddp.finish_grad_sync()
            opt.step()
            ddp.finish_param_sync()
        return _per_op(ledger, "dp-cp")
    finally:
        destroy_model_parallel(grid)


# --- EP: MoE all-to-all (alltoall dispatcher) ----------------------------------------
# The extension point for EP: `ep_rank` measures, `theory_ep` is the closed form, `ep_rows`
# turns them into lines; when `pentatron.models.moe.moe_layer` is missing (or fails to
# import) the suite prints "not measured" and never a made-up number.
EXPERTS, TOPK = 4, 2


def ep_available() -> bool:
    try:
        from pentatron.models.moe.moe_layer import MoELayer  # noqa: F401
    except ImportError:
        return False
    return True


def theory_ep(tokens: int, topk: int, h: int, e: int, ep: int) -> dict[str, int]:
    """Elements over all ep ranks of one fwd + bwd of an MoE layer, no token dropping.

    Each rank routes its `tokens` to `topk` experts: tokens*topk rows of h leave it in the
    dispatch (the part for its own experts included: all_to_all's payload is the whole
    input) and come back in the combine; backward runs both again on the grads. Per
    direction the ranks together move ep*tokens*topk*h; four directions in all. Which rank
    receives how many rows depends on the router, so only the sum over ranks is fixed.
    The forward also exchanges the per-expert counts: one int64 all-to-all of E per rank.
    """
    return {"all_to_all hidden": 4 * ep * tokens * topk * h, "all_to_all counts": ep * e}


def ep_rank() -> dict[str, list[int]]:
    """One fwd+bwd of an MoE layer (alltoall dispatcher) at ep = world size, tp = 1."""
    from pentatron.models import ModelParallel, TransformerConfig
    from pentatron.models.moe import MoELayer
    from pentatron.parallel_state import (
        ParallelConfig,
        comm,
        destroy_model_parallel,
        initialize_model_parallel,
    )

    ep = dist.get_world_size()
    grid = initialize_model_parallel(ParallelConfig(ep=ep))
    try:
        config = TransformerConfig(
            num_layers=1, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
            num_moe_experts=EXPERTS, moe_router_topk=TOPK, expert_model_parallel_size=ep,
            moe_token_dispatcher_type="alltoall", attention_dropout=0.0, hidden_dropout=0.0,
        )  # fmt: skip
        layer = MoELayer(config, parallel=ModelParallel.resolve(config, grid, None))
        torch.manual_seed(1 + dist.get_rank())
        x = torch.randn(S, B, H, requires_grad=True)
        with comm.trace() as ledger:
            layer(x)[0].sum().backward()
        out: dict[str, list[int]] = {}
        for r in ledger.records:
            if r.op == "all_to_all":
                key = "all_to_all counts" if r.dtype == torch.int64 else "all_to_all hidden"
                entry = out.setdefault(key, [0, 0])
                entry[0] += 1
                entry[1] += r.elements
        return out
    finally:
        destroy_model_parallel(grid)


def ep_rows(per_rank: list[dict[str, list[int]]] | None) -> list[dict[str, Any]]:
    label = f"EP e=2 alltoall E={EXPERTS} topk={TOPK} [s={S}, b={B}, h={H}]:"
    if per_rank is None:
        return [{"name": f"{label} all_to_all", "measured": None, "theory": None,
                 "note": "not measured: MoE not available"}]  # fmt: skip
    theory = theory_ep(S * B, TOPK, H, EXPERTS, len(per_rank))
    return [
        {"name": f"{label} {op} (sum over ranks)",
         "measured": sum(r.get(op, [0, 0])[1] for r in per_rank), "theory": n}
        for op, n in theory.items()
    ]  # fmt: skip


# --- all cases -----------------------------------------------------------------------------
def _rows(label: str, measured: dict, theory: dict) -> list[dict[str, Any]]:
    rows = []
    for op in sorted(set(measured) | set(theory)):
        got = measured.get(op, [0, 0])[1]
        rows.append({"name": f"{label} {op}", "measured": got, "theory": theory.get(op, 0)})
    return rows


def _ranked(results: list[dict], label: str, theory_of) -> list[dict[str, Any]]:
    """One row per op with every rank's elements summed; each rank checked on its own."""
    rows: dict[str, dict[str, Any]] = {}
    for res in results:
        res = dict(res)
        rank = res.pop("rank", [None])[0] if "rank" in res else None
        for row in _rows(label, res, theory_of(rank)):
            entry = rows.setdefault(row["name"], {"name": row["name"], "measured": 0, "theory": 0})
            if row["measured"] != row["theory"]:
                entry["mismatch"] = True
            entry["measured"] += row["measured"]
            entry["theory"] += row["theory"]
    for entry in rows.values():
        entry["name"] += " (per rank, summed)"
        if entry.pop("mismatch", False):
            entry["theory"] = -1  # some rank differs: force a ratio != 1 to show up
    return list(rows.values())


CASES = (
    ("tp", False), ("tp", True), ("pp", None, 4), ("pp", 2, 4), ("dp", False), ("dp", True),
)  # fmt: skip


def all_cases_rank() -> dict[str, Any]:
    """Every case of `CASES` (and EP when MoE is there) in one call: one 2-rank pool."""
    fns = {"tp": tp_rank, "pp": pp_rank, "dp": dp_rank}
    cases = [fns[case[0]](*case[1:]) for case in CASES]
    return {"cases": cases, "ep": ep_rank() if ep_available() else None}


def _label(case: tuple) -> str:
    kind = case[0]
    if kind == "tp":
        return f"TP t=2{' + SP' if case[1] else ''}, {LAYERS} layers [s={S}, b={B}, h={H}]:"
    if kind == "pp":
        return f"PP p=2 v={case[1] or 1} m={case[2]} [s={S}, b={B}, h={H}]:"
    return f"DP d=2 {'ZeRO-1' if case[1] else 'DDP'} N={sum(mlp_numels())}:"


def _theory(case: tuple):
    kind = case[0]
    if kind == "tp":
        return lambda rank: theory_tp(S, B, H, LAYERS, 2, case[1])
    if kind == "pp":
        return lambda rank: theory_pp(S, B, H, 2, case[1] or 1, case[2], rank)
    return lambda rank: theory_dp(mlp_numels(), 2, case[1])


def measure(pools: Any) -> list[dict[str, Any]]:
    """All cases; `pools` is a `PoolSet` (or the pytest `distributed` fixture)."""
    per_rank = pools.run(2, all_cases_rank)
    rows: list[dict[str, Any]] = []
    for i, case in enumerate(CASES):
        rows += _ranked([r["cases"][i] for r in per_rank], _label(case), _theory(case))
    ep = [r["ep"] for r in per_rank]
    rows += ep_rows(None if ep[0] is None else ep)
    return rows


def ratio(row: dict[str, Any]) -> float | None:
    if row.get("measured") is None or not row.get("theory"):
        return None
    return row["measured"] / row["theory"]


def main() -> None:
    from pentatron.parallel_state.testing import PoolSet

    pools = PoolSet()
    try:
        rows = measure(pools)
    finally:
        pools.close()
    for row in rows:
        r = ratio(row)
        if r is None:
            print(f"{row['name']:70s} {row.get('note', 'no theory')}")
        else:
            print(f"{row['name']:70s} {row['measured']:>10} / {row['theory']:>10} = {r:.2f}")


if __name__ == "__main__":
    main()
