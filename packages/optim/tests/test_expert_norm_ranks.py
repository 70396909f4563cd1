"""A pipeline rank without expert params still takes part in the expert norm's
all-reduces (DeepSeek's dense first layers, or an empty stage, on pipeline rank 0).

World 2 as pp2: rank 0 holds a dense layer, rank 1 a dense layer and an expert (marked
`allreduce = False`). The global grad norm, computed by every optimizer, equals the norm of
all grads written out here, on both ranks. Planted (each optimizer deciding alone whether
the model has experts, as pentatron-optim 0.1.7 did): rank 1 waits in the expert
all-reduce that rank 0 never issues, until the grid's timeout names the group.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from pentatron.optim import (
    DDPConfig,
    DistributedDataParallel,
    OptimizerConfig,
    apply_fsdp2,
    finalize_model_grads,
    get_optimizer,
)
from pentatron.optim.optimizer import fsdp_optimizer, mixed_precision
from pentatron.parallel_state import ParallelConfig, initialize_model_parallel

D = 4


def _layers(rank: int) -> torch.nn.Module:
    torch.manual_seed(3)
    dense, expert = torch.nn.Linear(D, D), torch.nn.Linear(D, D)
    for p in expert.parameters():
        p.allreduce = False  # Megatron's marker for expert params
    return torch.nn.Sequential(dense, expert) if rank == 1 else torch.nn.Sequential(dense)


def _grads(rank: int) -> list[torch.Tensor]:
    """Each rank's grads of a fixed loss, computed without the wrappers."""
    model = _layers(rank)
    model(torch.ones(2, D)).square().sum().backward()
    return [p.grad for p in model.parameters()]


def _norm(wrapper: str, plant: bool) -> float:
    grid = initialize_model_parallel(ParallelConfig(pp=2, timeout=timedelta(seconds=15)))
    rank = grid.rank("pp")
    if wrapper == "fsdp2":
        chunk = apply_fsdp2(_layers(rank), grid.group("dp-cp"))
    else:
        config = DDPConfig(use_distributed_optimizer=wrapper == "distopt")
        chunk = DistributedDataParallel(config, _layers(rank), grid=grid)
    modules = (mixed_precision, fsdp_optimizer)
    originals = [m.agree_has_experts for m in modules]
    if plant:  # every rank decides alone
        for m in modules:
            m.agree_has_experts = lambda local, grid=None: local
    try:
        opt = get_optimizer(
            OptimizerConfig(lr=0.1, clip_grad=1e9, use_distributed_optimizer=wrapper == "distopt"),
            [chunk],
            grid=grid,
        )
    finally:
        for m, original in zip(modules, originals):
            m.agree_has_experts = original
    chunk(torch.ones(2, D)).square().sum().backward()
    finalize_model_grads([chunk], grid=grid)
    return opt.step().grad_norm


@pytest.mark.parametrize("wrapper", ["ddp", "distopt", "fsdp2"])
def test_every_rank_reduces_the_expert_norm(distributed, wrapper):
    norms = distributed.run(2, _norm, wrapper, False)
    want = torch.cat([g.flatten() for r in (0, 1) for g in _grads(r)]).norm().item()
    assert norms == [pytest.approx(want, rel=1e-6)] * 2


def test_ranks_deciding_alone_time_out(distributed):
    with pytest.raises(Exception, match="etp-ep-pp"):
        distributed.run(2, _norm, "ddp", True)
