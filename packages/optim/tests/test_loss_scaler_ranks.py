"""fp16 dynamic loss scaling on the tp2-pp2-dp2 grid: an inf/nan on one rank skips the step on
all eight, leaves every param bit-identical, backs the scale off everywhere and is reported.

Ranks (order tp-cp-ep-dp-pp): rank = tp + 2 dp + 4 pp, so rank 1 differs from rank 0 in tp
only, rank 2 in dp only, rank 4 in pp only. An inf injected after the dp reduction is seen by
that rank alone; one injected before it reaches its dp peers through the all-reduce but not
its tp or pp peers. Both must stop the whole grid.
"""

import logging

import pytest
import torch

from pentatron.optim import (
    DDPConfig,
    DistributedDataParallel,
    OptimizerConfig,
    finalize_model_grads,
    get_optimizer,
)
from pentatron.parallel_state import ParallelConfig, initialize_model_parallel

INITIAL_SCALE = 2.0**10
# (rank that holds the bad grad, value, injected before or after the dp reduction)
INJECTIONS = [
    (0, float("inf"), "after"),
    (1, float("nan"), "after"),  # a tp peer of rank 0
    (2, float("inf"), "after"),  # a dp peer
    (4, float("-inf"), "after"),  # a pp peer
    (7, float("inf"), "after"),
    (5, float("nan"), "before"),  # reaches rank 7 through the dp all-reduce only
]


def _inject(ddp, value):
    """Put `value` into the first grad element this rank will step (its shard if sharded)."""
    buffer = ddp.dense_buffers[0]
    if buffer.sharded:
        buffer.grad_shard(buffer.buckets[0])[0] = value
    else:
        buffer.grad_data[0] = value


def skip_steps(dist_opt):
    grid = initialize_model_parallel(ParallelConfig(tp=2, pp=2))
    rank = torch.distributed.get_rank()
    torch.manual_seed(7 + rank)  # params differ across tp/pp ranks, as real shards do
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ddp = DistributedDataParallel(
        DDPConfig(use_distributed_optimizer=dist_opt, grad_reduce_in_fp32=True),
        module.half(),
        grid=grid,
    )
    opt = get_optimizer(
        OptimizerConfig(
            fp16=True,
            lr=1e-2,
            initial_loss_scale=INITIAL_SCALE,
            hysteresis=1,
            loss_scale_window=1000,
            use_distributed_optimizer=dist_opt,
        ),
        [ddp],
        grid=grid,
    )
    x = torch.randn(4, 8).half()
    out = []
    for bad_rank, value, when in [*INJECTIONS, (None, None, None)]:
        ddp.zero_grad_buffer()
        opt.scale_loss(ddp(x).float().pow(2).mean()).backward()
        if rank == bad_rank and when == "before":
            _inject(ddp, value)
        finalize_model_grads([ddp], grid=grid)
        if rank == bad_rank and when == "after":
            _inject(ddp, value)
        before = [p.detach().clone() for p in ddp.module.parameters()]
        result = opt.step()
        ddp.finish_param_sync()
        after = list(ddp.module.parameters())
        out.append(
            {
                "ok": result.update_successful,
                "used_scale": result.loss_scale,
                "scale": opt.get_loss_scale(),
                "skipped": opt.num_skipped_steps,
                "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
                "finite": all(bool(torch.isfinite(p).all()) for p in after),
            }
        )
    return out


@pytest.mark.parametrize("dist_opt", [False, True], ids=["mixed-precision", "distributed"])
def test_inf_on_one_rank_skips_the_step_everywhere(distributed, dist_opt):
    results = distributed.run(8, skip_steps, dist_opt)
    for rank, steps in enumerate(results):
        for i, (bad_rank, _, when) in enumerate(INJECTIONS):
            s = steps[i]
            where = f"rank {rank}, inf on rank {bad_rank} {when} the dp reduction"
            assert not s["ok"], where
            assert s["unchanged"], where
            assert s["used_scale"] == INITIAL_SCALE / 2**i, where
            assert s["scale"] == INITIAL_SCALE / 2 ** (i + 1), where  # hysteresis 1: back off
            assert s["skipped"] == i + 1, where
        clean = steps[-1]
        assert clean["ok"] and not clean["unchanged"] and clean["finite"], rank
        assert clean["scale"] == INITIAL_SCALE / 2 ** len(INJECTIONS), rank  # no growth yet


def single_rank_skip_logs():
    grid = initialize_model_parallel(ParallelConfig())
    ddp = DistributedDataParallel(DDPConfig(), torch.nn.Linear(2, 2).half(), grid=grid)
    opt = get_optimizer(OptimizerConfig(fp16=True, initial_loss_scale=4.0), [ddp], grid=grid)
    ddp.dense_buffers[0].grad_data.fill_(float("inf"))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("pentatron.optim").addHandler(handler)
    try:
        result = opt.step()
    finally:
        logging.getLogger("pentatron.optim").removeHandler(handler)
    return result.update_successful, [r.getMessage() for r in records]


def test_skipped_step_is_logged(distributed):
    for ok, messages in distributed.run(2, single_rank_skip_logs):
        assert not ok
        assert len(messages) == 1 and "step skipped on every rank" in messages[0]
        assert "loss scale 4 -> 4" in messages[0]  # hysteresis 2: the first overflow is kept
