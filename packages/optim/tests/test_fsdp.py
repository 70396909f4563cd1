"""FSDP2 (`apply_fsdp2`) at dp=2 vs one process on the concatenated batch, torch AdamW.

Tolerances: fp32 2e-5 absolute/relative (the reduce-scatter sums in another order than one
process); bf16 compute (`param_dtype=torch.bfloat16`, fp32 sharded params and fp32
reduce-scatter) vs the fp32 run 3e-2. Layer sizes are odd, so FSDP2 pads its shards.
"""

import pytest
import torch
from torch.distributed.tensor import DTensor

from pentatron.optim.distributed.fsdp import FSDP2DataParallel, apply_fsdp2, default_blocks
from pentatron.parallel_state import ParallelConfig, initialize_model_parallel

STEPS, BATCH, LR, WD = 3, 8, 1e-2, 0.1


class Block(torch.nn.Module):
    def __init__(self, h):
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.fc = torch.nn.Linear(h, h)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(5, 9)
        self.layers = torch.nn.ModuleList([Block(9), Block(9)])
        self.out = torch.nn.Linear(9, 3)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def make_model(seed=0):
    torch.manual_seed(seed)
    return Net()


def batch(step):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 3, generator=g)


def reference():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        x, y = batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def run_fsdp(case, grid):
    d, r = grid.size("dp"), grid.rank("dp")
    # Different seeds per rank: apply_fsdp2 broadcasts dp rank 0's params first.
    model = apply_fsdp2(
        make_model(seed=r),
        grid.group("dp-cp"),
        param_dtype=case.get("param_dtype"),
        reshard_after_forward=case.get("reshard", True),
    )
    assert isinstance(model, FSDP2DataParallel)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    micro = case.get("micro", 1)
    synced_early = False
    for step in range(STEPS):
        x, y = batch(step)
        xs, ys = x.chunk(d)[r].chunk(micro), y.chunk(d)[r].chunk(micro)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            ctx = model.no_sync() if i < micro - 1 else torch.enable_grad()
            with ctx:
                out = model(xm).float()
                (torch.nn.functional.mse_loss(out, ym) / micro).backward()
            if i < micro - 1:  # no reduce-scatter yet: the sharded grads are not written
                synced_early |= any(p.grad is not None for p in model.parameters())
        model.finish_grad_sync()
        opt.step()
        model.zero_grad_buffer()
    local = [p.to_local().numel() for p in model.parameters()]
    full = [p.full_tensor().detach().clone() for p in model.parameters()]
    kinds = {type(p).__name__ for p in model.parameters()}
    return {"params": full, "local": local, "kinds": kinds, "synced_early": synced_early}


CASES = [
    dict(),
    dict(reshard=False, micro=2),
    dict(param_dtype=torch.bfloat16),
]


def test_fsdp2_matches_single_process(distributed):
    ref = reference()
    results = distributed.run(2, run_fsdp_cases, CASES)
    for rank, per_case in enumerate(results):
        for case, got in zip(CASES, per_case):
            tol = 3e-2 if case.get("param_dtype") == torch.bfloat16 else 2e-5
            assert got["kinds"] == {DTensor.__name__}
            assert not got["synced_early"]
            for a, b in zip(got["params"], ref):
                torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=f"{case} rank {rank}")
            # each rank keeps ceil(n/2) rows of every param (dim 0 sharded, padded)
            assert got["local"] == [
                -(-p.shape[0] // 2) * p[0].numel()
                if rank == 0
                else (p.shape[0] - (-(-p.shape[0] // 2))) * p[0].numel()
                for p in ref
            ]
    bf16 = results[0][2]["params"]
    assert any(not torch.equal(a, b) for a, b in zip(bf16, ref))  # bf16 compute did happen


def run_fsdp_cases(cases):
    grid = initialize_model_parallel(ParallelConfig())
    return [run_fsdp(case, grid) for case in cases]


def test_default_blocks_are_module_list_children():
    model = make_model()
    assert default_blocks(model) == list(model.layers)


CLIP = 0.05  # small enough that every step clips


def _groups(model):
    from pentatron.optim import get_param_groups

    return get_param_groups([model])


def reference_clipped():
    """One process: Megatron's param groups (no wd on biases and 1-D), clip, AdamW."""
    model = make_model()
    groups = [{**g, "weight_decay": WD * g["wd_mult"]} for g in _groups(model)]
    opt = torch.optim.AdamW(groups, lr=LR)
    norms = []
    for step in range(STEPS):
        x, y = batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], norms


def run_fsdp_optimizer():
    from pentatron.optim import FSDP2Optimizer, OptimizerConfig, get_optimizer

    grid = initialize_model_parallel(ParallelConfig())
    d, r = grid.size("dp"), grid.rank("dp")
    net = make_model()
    net.inp.weight.tensor_model_parallel = True  # attributes must survive fully_shard
    net.out.bias.sequence_parallel = True
    model = apply_fsdp2(net, grid.group("dp-cp"))
    attrs = (
        getattr(model.module.inp.weight, "tensor_model_parallel", None),
        getattr(model.module.out.bias, "sequence_parallel", None),
    )
    config = OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP, log_num_zeros_in_grad=True)
    opt = get_optimizer(config, [model], grid=grid)
    assert isinstance(opt, FSDP2Optimizer)
    norms, zeros = [], []
    for step in range(STEPS):
        x, y = batch(step)
        torch.nn.functional.mse_loss(model(x.chunk(d)[r]), y.chunk(d)[r]).backward()
        result = opt.step()
        norms.append(result.grad_norm)
        zeros.append(result.num_zeros_in_grad)
        opt.zero_grad()
    return {"params": _gather_rows(model, grid), "norms": norms, "zeros": zeros, "attrs": attrs}


def _gather_rows(model, grid):
    """Full params from the dp shards by our own all-gather: DTensor.full_tensor caches its
    redistribution by mesh ranks, which a re-created group of the same ranks defeats."""
    import torch.distributed as dist

    out = []
    for p in model.parameters():
        parts = [None] * grid.size("dp")
        dist.all_gather_object(parts, p.to_local().detach().clone(), group=grid.group("dp-cp"))
        out.append(torch.cat(parts))
    return out


def test_fsdp2_optimizer_clips_by_the_global_norm(distributed):
    """Parity (fp32, 2e-5): grad norm over the dp shards, clipping and wd groups."""
    ref_params, ref_norms = reference_clipped()
    for got in distributed.run(2, run_fsdp_optimizer):
        assert got["attrs"] == (True, True)
        assert got["norms"] == pytest.approx(ref_norms, rel=2e-5)
        assert all(n > CLIP for n in ref_norms)  # clipping was active
        assert got["zeros"] == [0] * STEPS
        for a, b in zip(got["params"], ref_params):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def test_fsdp2_optimizer_refuses_fp16_and_distributed_optimizer():
    from pentatron.optim import FSDP2Optimizer, OptimConfigError, OptimizerConfig

    for config, field in [
        (OptimizerConfig(fp16=True), "fp16"),
        (OptimizerConfig(use_distributed_optimizer=True), "use_distributed_optimizer"),
    ]:
        with pytest.raises(OptimConfigError, match=field):
            FSDP2Optimizer(config, [], [], stats_groups=object())
