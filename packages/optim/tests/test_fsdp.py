"""FSDP2 (`apply_fsdp2`) at dp=2 vs one process on the concatenated batch, torch AdamW.

Every step of every case compares the grads FSDP2 reduce-scattered (the ranks' shards
joined) with plain torch autograd of the whole batch at the same params (||got - ref|| over
||ref||, per param), and the final
params with one process trained on the whole batch. Adam is scale-invariant, so the params
alone would pass a gradient scaled by a constant; the grads do not
(`test_a_planted_bug_fails_the_comparison`). Layer sizes are odd, so FSDP2 pads its shards.
Grad accumulation over 2 micro-batches: by default each micro-batch reduce-scatters, so
between them a rank holds only its fp32 grad shards (bytes counted from FSDP2's state);
with `defer_reduce=True` it holds every param's unsharded fp32 grad and nothing is reduced
until the last one (the behaviour before optim 0.1.7, which the default case fails).

Tolerances, from the largest error measured on 2026-12-05 and, for the grads, 2026-12-07
(both ranks, every case and step; PENTATRON_MEASURE=1 prints them):
- fp32: grads GRAD_RTOL = 2e-6 (measured 2.5e-7); params PARAM_TOL = 3e-7 absolute and
  relative (measured 3.0e-8 absolute).
- bf16 compute (`param_dtype=torch.bfloat16`, fp32 sharded params and fp32 reduce-scatter):
  grads against the same bf16 computation of the whole batch BF16_GRAD_RTOL = 1e-2
  (measured 3.7e-3; 2.7x; against fp32 they would differ by 3.3e-2, bf16's own error);
  params vs the fp32 reference BF16_PARAM_TOL = 5e-3 (measured 5.2e-4); every param
  must have moved from its initial value by more than 3 x BF16_PARAM_TOL (measured at least
  2.3e-2), so an untrained run fails.
- FSDP2Optimizer (fp32, clipping every step): grad norms before clipping NORM_RTOL = 1e-6
  (measured 0: bit-equal here; 1e-6 allows another summation order), params PARAM_TOL
  (measured 3.0e-8).
"""

import contextlib
import os
import sys

import pytest
import torch
from torch.distributed.tensor import DTensor

from pentatron.optim.distributed.fsdp import FSDP2DataParallel, apply_fsdp2, default_blocks
from pentatron.parallel_state import ParallelConfig, initialize_model_parallel

STEPS, BATCH, LR, WD = 3, 8, 1e-2, 0.1
GRAD_RTOL, PARAM_TOL, NORM_RTOL = 2e-6, 3e-7, 1e-6
BF16_GRAD_RTOL, BF16_PARAM_TOL = 1e-2, 5e-3
MEASURE = os.environ.get("PENTATRON_MEASURE") == "1"


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


def reference_grads(params, step, dtype=torch.float32):
    """Plain torch: autograd of the whole batch's mean loss at `params` (a list), the model
    and input in `dtype` (FSDP2's `param_dtype` casts both), the grads returned in fp32."""
    model = make_model().to(dtype)
    with torch.no_grad():
        for p, v in zip(model.parameters(), params):
            p.copy_(v)
    x, y = batch(step)
    torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
    return [p.grad.float() for p in model.parameters()]


def microbatch_loss(loss, micro):
    """A micro-batch's share of the step's loss: the mean over micro-batches."""
    return loss / micro


def _local(tensors):
    return [t.to_local().detach().float().clone() for t in tensors]


def run_fsdp(case, grid):
    d, r = grid.size("dp"), grid.rank("dp")
    # Different seeds per rank: apply_fsdp2 broadcasts dp rank 0's params first.
    model = apply_fsdp2(
        make_model(seed=r),
        grid.group("dp-cp"),
        param_dtype=case.get("param_dtype"),
        reshard_after_forward=case.get("reshard", True),
        defer_reduce=case.get("defer", False),
    )
    assert isinstance(model, FSDP2DataParallel)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    micro = case.get("micro", 1)
    synced_early, held = False, 0
    # this rank's shards, joined over the ranks by the test: params before each step,
    # the reduced grads of each step
    before, grads = [], []
    for step in range(case.get("steps", STEPS)):
        before.append(_local(model.parameters()))
        x, y = batch(step)
        xs, ys = x.chunk(d)[r].chunk(micro), y.chunk(d)[r].chunk(micro)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            ctx = model.no_sync() if i < micro - 1 else torch.enable_grad()
            with ctx:
                out = model(xm).float()
                microbatch_loss(torch.nn.functional.mse_loss(out, ym), micro).backward()
            if i < micro - 1:  # reduce-scattered already (default), or held unsharded
                synced_early |= any(p.grad is not None for p in model.parameters())
                held = max(held, _grad_bytes_held(model))
        model.finish_grad_sync()
        grads.append(_local(p.grad for p in model.parameters()))
        opt.step()
        model.zero_grad_buffer()
    local = [p.to_local().numel() for p in model.parameters()]
    # our shards, joined by the test: DTensor.full_tensor fails in a later run in the same
    # worker (it caches its redistribution by mesh ranks; see `_gather_rows`)
    final = _local(model.parameters())
    kinds = {type(p).__name__ for p in model.parameters()}
    return {
        "params": final,
        "local": local,
        "kinds": kinds,
        "synced_early": synced_early,
        "held": held,
        "before": before,
        "grads": grads,
    }


def _grad_bytes_held(model) -> int:
    """Bytes of grads the model holds between micro-batches: its sharded grads and any
    unsharded ones FSDP2 keeps for a deferred reduce-scatter (FSDP2-private state)."""
    from torch.distributed.fsdp import FSDPModule

    total = sum(p.grad.to_local().nbytes for p in model.parameters() if p.grad is not None)
    for m in model.module.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        for fp in group.fsdp_params if group is not None else ():
            for g in (fp.unsharded_accumulated_grad, fp._unsharded_param.grad):
                total += g.nbytes if g is not None else 0
    return total


def _joined(shards_per_rank):
    """Full tensors from each rank's list of dim-0 shards (in rank order)."""
    return [torch.cat(shards) for shards in zip(*shards_per_rank)]


def check_against_reference(case, per_rank, ref, errors=None):
    """Raise AssertionError where the run of `case` (every rank's result) leaves the
    tolerances: each step's joined grads vs autograd at the joined params, final params."""
    bf16 = case.get("param_dtype") == torch.bfloat16
    grad_rtol = BF16_GRAD_RTOL if bf16 else GRAD_RTOL
    param_tol = BF16_PARAM_TOL if bf16 else PARAM_TOL
    errors = {} if errors is None else errors
    for step in range(len(per_rank[0]["grads"])):
        # bf16: the grads of the same bf16 computation on the whole batch the ranks split
        params = _joined(got["before"][step] for got in per_rank)
        expect = reference_grads(params, step, torch.bfloat16 if bf16 else torch.float32)
        grads = _joined(got["grads"][step] for got in per_rank)
        for i, (grad, ref_grad) in enumerate(zip(grads, expect)):
            err = float((grad - ref_grad).norm() / ref_grad.norm())
            errors["grad"] = max(errors.get("grad", 0.0), err)
            if err > grad_rtol:
                raise AssertionError(
                    f"grads differ: {case} step {step} param {i}: ||got - ref|| / "
                    f"||ref|| = {err:.3g} > {grad_rtol}"
                )
    if ref is None:  # a short run: grads only
        return errors
    final = _joined(got["params"] for got in per_rank)
    for a, b in zip(final, ref):
        errors["param"] = max(errors.get("param", 0.0), float((a - b).abs().max()))
        torch.testing.assert_close(
            a, b, atol=param_tol, rtol=param_tol, msg=f"params differ: {case}"
        )
    return errors


CASES = [
    dict(),
    dict(reshard=False, micro=2),
    dict(micro=2, defer=True),
    dict(param_dtype=torch.bfloat16),
]


def test_fsdp2_matches_single_process(distributed):
    ref = reference()
    results = distributed.run(2, run_fsdp_cases, CASES)
    measured = {"fp32": {}, "bf16": {}}
    for i, case in enumerate(CASES):
        per_rank = [per_case[i] for per_case in results]
        bf16 = case.get("param_dtype") == torch.bfloat16
        check_against_reference(case, per_rank, ref, measured["bf16" if bf16 else "fp32"])
        if bf16:  # it trained: every param moved by much more than the tolerance
            init = _joined(got["before"][0] for got in per_rank)
            final = _joined(got["params"] for got in per_rank)
            for j, (a, b) in enumerate(zip(final, init)):
                moved = float((a - b).abs().max())
                measured["bf16"]["moved"] = min(measured["bf16"].get("moved", 1.0), moved)
                assert moved > 3 * BF16_PARAM_TOL, f"{case} param {j} moved {moved}"
    if MEASURE:
        print(f"\nmeasured max errors: {measured}")
    for rank, per_case in enumerate(results):
        for case, got in zip(CASES, per_case):
            assert got["kinds"] == {DTensor.__name__}
            if case.get("micro", 1) > 1:  # grad accumulation's memory between micro-batches
                local = sum(got["local"]) * 4  # this rank's fp32 grad shards
                if case.get("defer"):  # unsharded fp32 grads of every param, not reduced
                    assert not got["synced_early"]
                    assert got["held"] == sum(p.numel() for p in ref) * 4
                else:  # each micro-batch reduce-scattered: only this rank's shards
                    assert got["synced_early"]
                    assert got["held"] == local
            # each rank keeps ceil(n/2) rows of every param (dim 0 sharded, padded)
            assert got["local"] == [
                -(-p.shape[0] // 2) * p[0].numel()
                if rank == 0
                else (p.shape[0] - (-(-p.shape[0] // 2))) * p[0].numel()
                for p in ref
            ]
    bf16 = _joined(per_case[3]["params"] for per_case in results)
    assert any(not torch.equal(a, b) for a, b in zip(bf16, ref))  # bf16 compute did happen


def run_fsdp_cases(cases, plant=None):
    grid = initialize_model_parallel(ParallelConfig())
    with _planted(plant):
        return [run_fsdp(case, grid) for case in cases]


# Bugs the comparison must see, each planted in the real code for one run:
#   grad_x2 / grad_x0.5: every reduced grad scaled (by `finish_grad_sync`);
#   no_microbatch_average: the 1/micro-batches factor dropped from the loss;
#   dp_sum: FSDP2's reduce-scatter sums over dp instead of averaging.
PLANTS = ("grad_x2", "grad_x0.5", "no_microbatch_average", "dp_sum")


def _planted(plant):
    """A context that plants `plant` (one of PLANTS) by patching the code that owns it."""
    from unittest import mock

    from pentatron.optim.distributed import fsdp

    if plant is None:
        return contextlib.nullcontext()
    if plant in ("grad_x2", "grad_x0.5"):
        factor = 2.0 if plant == "grad_x2" else 0.5
        finish = FSDP2DataParallel.finish_grad_sync

        def finish_scaled(self):
            finish(self)
            self.scale_gradients(factor)

        return mock.patch.object(FSDP2DataParallel, "finish_grad_sync", finish_scaled)
    if plant == "no_microbatch_average":
        return mock.patch.object(sys.modules[__name__], "microbatch_loss", lambda loss, m: loss)
    if plant == "dp_sum":
        shard = fsdp.fully_shard

        def summing(module, **kw):
            out = shard(module, **kw)
            out.set_gradient_divide_factor(1.0)  # with plain SUM (gloo has no PREMUL_SUM)
            out.set_force_sum_reduction_for_comms(True)
            return out

        return mock.patch.object(fsdp, "fully_shard", summing)
    raise ValueError(f"plant {plant!r}: one of {PLANTS}")


PLANT_CASE = dict(reshard=False, micro=2, steps=1)


@pytest.mark.parametrize("plant", [None, *PLANTS])
def test_a_planted_bug_fails_the_comparison(distributed, plant):
    """None: the same short run without a bug passes, so each failure is the bug's (one
    step: its grads are compared, not the final params)."""
    per_rank = [r[0] for r in distributed.run(2, run_fsdp_cases, [PLANT_CASE], plant)]
    if plant is None:
        check_against_reference(PLANT_CASE, per_rank, None)
        return
    with pytest.raises(AssertionError, match="grads differ"):
        check_against_reference(PLANT_CASE, per_rank, None)


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
    """Parity (fp32): grad norm over the dp shards before clipping (it carries the grads'
    scale, which clipping every step hides from the params), clipping and wd groups."""
    ref_params, ref_norms = reference_clipped()
    norm_err = param_err = 0.0
    for got in distributed.run(2, run_fsdp_optimizer):
        assert got["attrs"] == (True, True)
        norm_err = max(norm_err, *(abs(a / b - 1) for a, b in zip(got["norms"], ref_norms)))
        param_err = max(
            param_err, *(float((a - b).abs().max()) for a, b in zip(got["params"], ref_params))
        )
        assert got["norms"] == pytest.approx(ref_norms, rel=NORM_RTOL)
        assert all(n > CLIP for n in ref_norms)  # clipping was active
        assert got["zeros"] == [0] * STEPS
        for a, b in zip(got["params"], ref_params):
            torch.testing.assert_close(a, b, atol=PARAM_TOL, rtol=PARAM_TOL)
    if MEASURE:
        print(f"\nFSDP2Optimizer measured max errors: norm {norm_err}, param {param_err}")


def test_fsdp2_optimizer_refuses_fp16_and_distributed_optimizer():
    from pentatron.optim import FSDP2Optimizer, OptimConfigError, OptimizerConfig

    for config, field in [
        (OptimizerConfig(fp16=True), "fp16"),
        (OptimizerConfig(use_distributed_optimizer=True), "use_distributed_optimizer"),
    ]:
        with pytest.raises(OptimConfigError, match=field):
            FSDP2Optimizer(config, [], [], stats_groups=object())


def run_forward_only_then_reshard():
    from pentatron.optim.distributed.fsdp import local_tensor

    grid = initialize_model_parallel(ParallelConfig())
    model = apply_fsdp2(make_model(), grid.group("dp-cp"))
    d, r = grid.size("dp"), grid.rank("dp")
    full = {n: p.shape[0] for n, p in model.named_parameters()}
    # torch.chunk's cut: ceil(n/d) rows a rank, the last ones fewer
    shard_rows = {n: min(k, (r + 1) * -(-k // d)) - min(k, r * -(-k // d)) for n, k in full.items()}

    def local_rows():
        return {n: local_tensor(p).shape[0] for n, p in model.named_parameters()}

    with torch.no_grad():
        model(batch(0)[0])  # forward only: nothing reshards the root after it
    after_forward = local_rows()
    model.reshard()
    # the root's params are back to this rank's rows, which held_rows (checkpointing) needs
    held = [hi - lo for lo, hi in (model.held_rows(p) for p in model.parameters())]
    return after_forward, local_rows(), shard_rows, full, held


def test_reshard_frees_what_a_forward_only_pass_gathered(distributed):
    """An evaluation (forward only) leaves the root's params unsharded; `reshard()` returns
    every param to its `ceil(n/d)`-row shard."""
    for after_forward, after, shard_rows, full, held in distributed.run(
        2, run_forward_only_then_reshard
    ):
        # the bug the app's evaluation ran into: the root's params (inp, out) stay whole
        assert after_forward["module.inp.weight"] == full["module.inp.weight"]
        assert after == shard_rows and held == list(shard_rows.values())


class _WithExperts(torch.nn.Module):
    """A dense linear and an expert module (Megatron's `allreduce = False` marker)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.dense = torch.nn.Linear(4, 6)
        self.experts = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
        for p in self.experts.parameters():
            p.allreduce = False

    def forward(self, x):
        return self.experts(self.dense(x))


def _expert_dp_grads():
    from pentatron.optim.distributed.fsdp import expert_blocks

    grid = initialize_model_parallel(ParallelConfig(ep=2))
    model = _WithExperts()
    assert expert_blocks(model) == [model.experts]  # the outermost expert-only module
    # local grads every rank computes, for the test to reduce by hand
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(grid.global_rank))
    ref = _WithExperts()
    ref(x).square().sum().backward()
    local = {n: p.grad.clone() for n, p in ref.named_parameters()}
    fsdp = apply_fsdp2(model, grid.group("dp-cp"), expert_dp=grid.group("edp"))
    fsdp(x).square().sum().backward()
    shards = {
        n: (p.grad.to_local().clone(), fsdp.held_rows(p)) for n, p in model.named_parameters()
    }
    return local, shards, grid.ranks("edp"), grid.global_rank


def test_experts_shard_over_their_own_group_and_reduce_as_ddp(distributed):
    """With `expert_dp`, expert params are cut over the edp group (2 ranks) and their grads
    are summed over it and divided by dp (4), as our DDP reduces them; dense params over dp.
    Dividing experts by their own group's size (FSDP2's default) would double them here."""
    results = distributed.run(4, _expert_dp_grads)
    for _own, shards, edp, rank in results:
        for name, (shard, (lo, hi)) in shards.items():
            if name.startswith("experts."):  # cut over edp: 2 parts
                want = sum(results[r][0][name] for r in edp) / 4
                part, idx = -(-want.shape[0] // 2), edp.index(rank)
            else:  # over dp: 4 parts
                want = sum(r[0][name] for r in results) / 4
                part, idx = -(-want.shape[0] // 4), rank
            assert (lo, hi) == (
                min(idx * part, want.shape[0]),
                min((idx + 1) * part, want.shape[0]),
            )
            torch.testing.assert_close(shard, want[lo:hi], rtol=1e-6, atol=1e-7, msg=name)
