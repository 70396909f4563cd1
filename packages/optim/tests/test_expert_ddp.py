"""Expert params reduce over the expert-data-parallel group, dense ones over dp x cp.

Grid: world 4, ep=2, so dp=4 and edp=2 (ep groups [0,1] [2,3]; edp groups [0,2] [1,3]).
Each rank holds the dense layer and expert `ep_rank` (marked `allreduce = False`, as
Megatron's expert layers are). Tokens reach the experts like the all-gather dispatcher:
`h[b]` -> all-gather(ep) -> `[2b]`, the local expert runs on the tokens routed to it, and
the partial outputs go back by reduce-scatter(ep). The single-process reference runs the
dense layer and both experts on the whole batch of 4b tokens.

Tolerance 1e-5 (fp32; only the summation order differs).
"""

import pytest
import torch
import torch.distributed as dist

from pentatron.optim import (
    DDPConfig,
    DistributedDataParallel,
    OptimizerConfig,
    finalize_model_grads,
    get_optimizer,
)
from pentatron.parallel_state import ParallelConfig, comm, initialize_model_parallel

D, H, TOKENS, EXPERTS, STEPS, LR, CLIP = 6, 8, 4, 2, 3, 1e-2, 0.05
TOL = 1e-5


def batch(step, world=4):
    g = torch.Generator().manual_seed(10 + step)
    x = torch.randn(world * TOKENS, D, generator=g)
    y = torch.randn(world * TOKENS, H, generator=g)
    route = torch.randint(0, EXPERTS, (world * TOKENS,), generator=g)
    return x, y, route


class Model(torch.nn.Module):
    """Dense layer plus the experts in `experts` (all of them in the reference)."""

    def __init__(self, experts):
        super().__init__()
        torch.manual_seed(5)
        self.dense = torch.nn.Linear(D, H)
        all_experts = [torch.nn.Linear(H, H) for _ in range(EXPERTS)]
        self.experts = torch.nn.ModuleList(all_experts[e] for e in experts)
        self.ids = list(experts)
        for expert in self.experts:
            for p in expert.parameters():
                p.allreduce = False  # Megatron's marker for expert params


def reference():
    """One process, whole batch: grads after the first step's backward, params per step."""
    model = Model(range(EXPERTS))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    grads, params = None, []
    for step in range(STEPS):
        x, y, route = batch(step)
        h = model.dense(x)
        out = sum((route == e)[:, None] * model.experts[e](h) for e in range(EXPERTS))
        torch.nn.functional.mse_loss(out, y).backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return grads, params


def forward_loss(ddp, grid, step):
    from pentatron.tp_layers import (
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )

    x, y, route = batch(step)
    rows = slice(grid.rank("dp") * TOKENS, (grid.rank("dp") + 1) * TOKENS)
    ep_group = grid.group("ep")
    model = ddp.module
    h = model.dense(x[rows])
    h_all = gather_from_sequence_parallel_region(h, ep_group)  # [b] -> [2b] over ep
    route_all = torch.empty(2 * TOKENS, dtype=route.dtype)
    dist.all_gather_into_tensor(route_all, route[rows].contiguous(), group=ep_group)
    (expert_id,) = model.ids
    partial = (route_all == expert_id)[:, None] * model.experts[0](h_all)
    out = reduce_scatter_to_sequence_parallel_region(partial, ep_group)  # [2b] -> [b]
    return torch.nn.functional.mse_loss(out, y[rows])


def train(dist_opt, overlap):
    grid = initialize_model_parallel(ParallelConfig(ep=2))
    assert grid.size("edp") == 2 and grid.size("dp") == 4
    ddp = DistributedDataParallel(
        DDPConfig(use_distributed_optimizer=dist_opt, overlap_grad_reduce=overlap, bucket_size=40),
        Model([grid.rank("ep")]),
        grid=grid,
    )
    opt = get_optimizer(
        OptimizerConfig(
            lr=LR, weight_decay=0.0, clip_grad=CLIP, use_distributed_optimizer=dist_opt
        ),
        [ddp],
        grid=grid,
    )
    grads, params, groups = None, [], set()
    for step in range(STEPS):
        with comm.trace() as ledger:
            forward_loss(ddp, grid, step).backward()
            finalize_model_grads([ddp], grid=grid)
        groups |= {(r.op, r.group) for r in ledger.records if r.group in ("edp", "dp-cp")}
        if grads is None and not dist_opt:
            grads = {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()}
        opt.step()
        opt.zero_grad()
        ddp.finish_param_sync()
        params.append({n: p.detach().clone() for n, p in ddp.module.named_parameters()})
    return {"ep": grid.rank("ep"), "grads": grads, "params": params, "groups": groups}


def _ref_name(name, expert_id):
    return name.replace("experts.0.", f"experts.{expert_id}.")


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.parametrize(
    ("dist_opt", "overlap"), [(False, False), (False, True), (True, True)], ids=str
)
def test_expert_grads_and_steps_match_one_process(distributed, ref, dist_opt, overlap):
    ref_grads, ref_params = ref
    reduce = "reduce_scatter" if dist_opt else "all_reduce"
    for rank, got in enumerate(distributed.run(4, train, dist_opt, overlap)):
        assert got["ep"] == rank % 2
        assert {(reduce, "edp"), (reduce, "dp-cp")} <= got["groups"], got["groups"]
        if got["grads"] is not None:
            for name, grad in got["grads"].items():
                expected = ref_grads[_ref_name(name, got["ep"])]
                torch.testing.assert_close(
                    grad, expected, atol=TOL, rtol=TOL, msg=f"rank {rank} grad {name}"
                )
        for step in range(STEPS):
            for name, value in got["params"][step].items():
                expected = ref_params[step][_ref_name(name, got["ep"])]
                torch.testing.assert_close(
                    value, expected, atol=TOL, rtol=TOL, msg=f"rank {rank} step {step} {name}"
                )
