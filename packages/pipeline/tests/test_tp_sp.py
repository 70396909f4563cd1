"""Pipeline composed with tensor + sequence parallelism in one grid (tp2 x pp2, world 4).

A stack of 8 residual MLP blocks built from `pentatron.tp_layers` (Column -> tanh -> Row,
sequence_parallel=True), so every tensor crossing a stage boundary is `[s/t, b, h]`.
Losses and the tp-gathered gradients equal the single-process model's (fp64, atol 1e-10;
tp only splits the sums of the row layer); the ledger shows s/t*b*h elements per boundary
message, m each way over each of the p*v-1 boundaries of each tp rank's pipeline.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from pentatron.parallel_state import ParallelConfig, comm, initialize_model_parallel
from pentatron.pipeline import (
    PipelineConfig,
    StageLayout,
    Timeline,
    get_forward_backward_func,
    v_stage,
    zb_h1_rank_schedule,
    zbv_schedules,
)

tp_layers = pytest.importorskip("pentatron.tp_layers")  # the `test` extra installs it

S, B, H, F, LAYERS, TP, PP = 4, 2, 8, 16, 8, 2, 2
ATOL = 1e-10
DT = torch.float64


def _master(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Full (unsharded) weights of every block; the biases are non-zero on purpose."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=DT) * 0.3

    return [dict(w1=rnd(F, H), b1=rnd(F), w2=rnd(H, F), b2=rnd(H)) for _ in range(LAYERS)]


def _data(m: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(m):
        mask = (torch.rand(S, B, generator=g) > 0.3).to(DT)
        mask[0, 0] = 1.0
        x = torch.randn(S, B, H, generator=g, dtype=DT)
        out.append((x, torch.randn(S, B, H, generator=g, dtype=DT), mask))
    return out


def _reference(m: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """The same model in one process: per-micro-batch losses, grads of loss / m summed."""
    params = [{k: t.clone().requires_grad_() for k, t in blk.items()} for blk in _master()]
    losses = []
    for x, target, mask in _data(m):
        h = x
        for p in params:
            h = h + torch.tanh(h @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"]
        loss = (((h - target) ** 2).sum(-1) * mask).sum() / mask.sum()
        (loss / m).backward()
        losses.append(loss.item())
    return losses, [{k: t.grad for k, t in p.items()} for p in params]


class _Block(torch.nn.Module):
    """`[s/t, b, h]` -> all-gather(tp) -> fc1 `[s, b, F/t]` -> tanh -> fc2 -> reduce-scatter(tp)
    -> `[s/t, b, h]`, plus the residual."""

    def __init__(self, master: dict[str, torch.Tensor], tp_group, tp_rank: int, tp: int) -> None:
        super().__init__()
        kw = dict(tp_group=tp_group, sequence_parallel=True, params_dtype=DT)
        self.fc1 = tp_layers.ColumnParallelLinear(H, F, **kw)
        self.fc2 = tp_layers.RowParallelLinear(F, H, input_is_parallel=True, **kw)
        part = slice(tp_rank * F // tp, (tp_rank + 1) * F // tp)
        with torch.no_grad():
            self.fc1.weight.copy_(master["w1"][part])
            self.fc1.bias.copy_(master["b1"][part])
            self.fc2.weight.copy_(master["w2"][:, part])
            self.fc2.bias.copy_(master["b2"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)[0]))[0]


class _Chunk(torch.nn.Module):
    def __init__(self, master, layers: range, takes_data: bool, tp_group, tp_rank: int, tp: int):
        super().__init__()
        self.layers, self.takes_data = layers, takes_data
        self.blocks = torch.nn.ModuleList(_Block(master[i], tp_group, tp_rank, tp) for i in layers)
        self.input_tensor = None

    def set_input_tensor(self, tensors: list) -> None:
        self.input_tensor = tensors[0]

    def forward(self, x_shard: torch.Tensor) -> torch.Tensor:
        h = x_shard if self.takes_data else self.input_tensor
        for block in self.blocks:
            h = block(h)
        return h


def _gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size(group))]
    comm.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def _run(case: dict) -> dict:
    vpp, m, schedule = case.get("vpp"), case["m"], case.get("schedule")
    tp, pp = case.get("tp", TP), case.get("pp", PP)
    zbv = schedule == "zbv"
    v = 2 if zbv else vpp or 1
    grid = initialize_model_parallel(ParallelConfig(tp=tp, pp=pp, vpp=vpp))
    tp_group, tp_rank, pp_rank = grid.group("tp"), grid.rank("tp"), grid.rank("pp")
    layout = StageLayout(LAYERS, pp, vpp)
    master = _master()

    def layers(c: int) -> range:
        if not zbv:
            return layout.layers(pp_rank, c)
        per, stage = LAYERS // (2 * pp), v_stage(pp, pp_rank, c)  # the V: down, then up
        return range(stage * per, (stage + 1) * per)

    chunks = [
        _Chunk(master, layers(c), pp_rank == 0 and c == 0, tp_group, tp_rank, tp) for c in range(v)
    ]
    last = [
        (pp_rank == 0 and c == 1) if zbv else (pp_rank == pp - 1 and c == v - 1) for c in range(v)
    ]
    seq = slice(tp_rank * S // tp, (tp_rank + 1) * S // tp)  # this rank's positions

    freed_at_backward: list[bool] = []  # per sent output: its data was gone when B reached it

    def forward_step(it, model):
        x, target, mask = next(it)
        out = model(x[seq].contiguous())
        if not last[chunks.index(model)] and not (zbv and pp_rank == pp - 1 and model is chunks[0]):
            # A sent output (not the loss, not ZBV's in-memory turn). Held weakly: a hook
            # that holds its own tensor is a cycle through C++ that gc cannot break, and it
            # kept each stage's graph, with the tp group its autograd contexts hold, alive.
            sent = weakref.ref(out)
            out.register_hook(lambda g: freed_at_backward.append(sent().numel() == 1))

        def loss_func(output):
            # This rank's share of the micro-batch loss; the shares sum to the full loss.
            local = (((output - target[seq]) ** 2).sum(-1) * mask[seq]).sum() / mask.sum()
            return local, local.detach().clone()

        return out, loss_func

    config = PipelineConfig(
        hidden_size=H,
        pipeline_dtype=DT,
        sequence_parallel=True,
        batch_p2p_comm=case.get("batch", True),
        deallocate_pipeline_outputs=case.get("dealloc", False),
        weight_grad_store=tp_layers.WeightGradStore() if schedule in ("zb-h1", "zbv") else None,
    )
    data = _data(m)
    timeline = Timeline(rank=pp_rank)
    with comm.trace() as ledger:
        losses = get_forward_backward_func(pp, vpp, schedule)(
            forward_step_func=forward_step,
            data_iterator=[iter(data) for _ in range(v)],
            model=chunks,
            num_microbatches=m,
            seq_length=S,
            micro_batch_size=B,
            forward_only=case.get("forward_only", False),
            config=config,
            grid=grid,
            timeline=timeline,
        )
    sends = [(x.op, x.elements) for x in ledger.records if x.op in ("send", "recv")]
    if any(last):
        losses = torch.stack(losses)
        comm.all_reduce(losses, group=tp_group)  # the shares of each micro-batch's loss
    for chunk in chunks:  # row biases saw s/t positions per rank
        tp_layers.sync_sequence_parallel_grads(chunk, tp_group)
    ref_losses, ref_grads = _reference(m)
    err = 0.0
    for chunk in [] if case.get("forward_only") else chunks:
        for i, block in zip(chunk.layers, chunk.blocks):
            got = dict(
                w1=_gather(block.fc1.weight.grad, 0, tp_group),
                b1=_gather(block.fc1.bias.grad, 0, tp_group),
                w2=_gather(block.fc2.weight.grad, 1, tp_group),
                b2=block.fc2.bias.grad,
            )
            for k, g in got.items():
                err = max(err, (g - ref_grads[i][k]).abs().max().item())
    loss_err = max(abs(a - b) for a, b in zip(losses.tolist(), ref_losses)) if any(last) else None
    return {
        "pp_rank": pp_rank,
        "grad_err": err,
        "nlayers": sum(len(c.layers) for c in chunks),
        "loss_err": loss_err,
        "sends": sends,
        "ops": [(o.kind, o.microbatch, o.chunk) for o in timeline.ops()],
        "freed_at_backward": freed_at_backward,
    }


CASES = [
    dict(m=4),
    dict(m=2, batch=False, dealloc=True),
    dict(m=4, vpp=2, batch=False),
    dict(m=6, vpp=2, dealloc=True),
    # ZB-H1: B and W split, W's where the table puts them; same numbers as 1F1B.
    dict(m=4, schedule="zb-h1"),
    dict(m=3, schedule="zb-h1", batch=False, dealloc=True),
    dict(m=5, schedule="zb-h1", tp=1, pp=4),
    dict(m=2, schedule="zb-h1", tp=1, pp=4),  # fewer micro-batches than stages
    dict(m=4, schedule="zb-h1", tp=1, pp=4, batch=False, dealloc=True),  # even/odd p2p order
    # ZBV: two chunks per rank in a V, its table's order, the loss on pipeline rank 0.
    dict(m=4, schedule="zbv"),
    dict(m=3, schedule="zbv", dealloc=True),
    dict(m=8, schedule="zbv", tp=1, pp=4),
    dict(m=2, schedule="zbv", tp=1, pp=4),  # fewer micro-batches than stages
    dict(m=5, schedule="zbv", tp=1, pp=4, forward_only=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_pipeline_with_tensor_and_sequence_parallel_matches_one_process(distributed, case):
    tp, pp = case.get("tp", TP), case.get("pp", PP)
    results = distributed.run(tp * pp, _run, case)
    m, v, schedule = case["m"], case.get("vpp") or 1, case.get("schedule")
    per_message = S // tp * B * H  # [s/t, b, h]
    for r in results:
        # deallocate_pipeline_outputs: every sent output's data is gone before its
        # backward reaches it (ZBV frees once the send completed); without it, none is.
        freed = r["freed_at_backward"]
        assert freed == [bool(case.get("dealloc"))] * len(freed), (r["pp_rank"], freed)
    assert case.get("forward_only") or sum(len(r["freed_at_backward"]) for r in results) > 0
    if schedule == "zbv":
        _check_zbv(results, m, pp, tp, per_message, bool(case.get("forward_only")))
        return
    for r in results:
        if schedule == "zb-h1":
            table = zb_h1_rank_schedule(pp, r["pp_rank"], m)
            assert r["ops"] == [(o.kind, o.microbatch, o.chunk) for o in table], r["pp_rank"]
        else:
            assert {kind for kind, *_ in r["ops"]} <= {"F", "B"}
        assert r["grad_err"] <= ATOL, (case, r)
        if r["pp_rank"] == pp - 1:
            assert r["loss_err"] is not None and r["loss_err"] <= ATOL, (case, r)
        assert {e for _, e in r["sends"]} == {per_message}, r["sends"]
        # Boundaries of this rank's pipeline: the chunk boundaries leaving it carry m
        # activations forward, those entering it m grads back (p*v - 1 in all).
        fwd = m * v - (m if r["pp_rank"] == pp - 1 else 0)
        bwd = m * v - (m if r["pp_rank"] == 0 else 0)
        assert sum(op == "send" for op, _ in r["sends"]) == fwd + bwd
        assert sum(op == "recv" for op, _ in r["sends"]) == fwd + bwd
    # Every layer sits on exactly one stage of each tp rank's pipeline.
    assert sum(r["nlayers"] for r in results) == tp * LAYERS
    # Each pipeline (one per tp rank): 2 * m * (p*v - 1) messages sent.
    assert sum(op == "send" for r in results for op, _ in r["sends"]) == tp * 2 * m * (pp * v - 1)


def _check_zbv(
    results: list, m: int, pp: int, tp: int, per_message: int, forward_only: bool
) -> None:
    """ZBV: grads and the losses (on pipeline rank 0) as one process; each rank ran its
    table; messages: each of the 2p - 2 boundaries between ranks (the turn at rank p - 1
    stays in memory) carries m activations and m grads, so rank r sends 2m down unless it
    is the last rank and 2m up unless it is the first."""
    tables = zbv_schedules(pp, m)
    ways = 1 if forward_only else 2  # activations, and grads when training
    for r in results:
        rank = r["pp_rank"]
        assert r["grad_err"] <= ATOL, r
        table = [(o.kind, o.microbatch, o.chunk) for o in tables[rank]]
        if forward_only:  # the table's F's, in its order
            table = [op for op in table if op[0] == "F"]
        assert r["ops"] == table, rank
        if rank == 0:
            assert r["loss_err"] is not None and r["loss_err"] <= ATOL, r
        assert {e for _, e in r["sends"]} <= {per_message}, r["sends"]
        want = ways * m * ((rank < pp - 1) + (rank > 0))
        assert sum(op == "send" for op, _ in r["sends"]) == want, (rank, r["sends"])
        assert sum(op == "recv" for op, _ in r["sends"]) == want
    assert sum(r["nlayers"] for r in results) == tp * LAYERS
