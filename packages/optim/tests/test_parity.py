"""DDP and optimizers at dp = 2 and 4 vs one process on the whole batch (torch.optim.AdamW).

Each case is compared three ways, every step, on every rank:
- the reduced grads the optimizer steps on (DDP's `main_grad` after `finalize_model_grads`,
  with the distributed optimizer this rank's shard of it) against plain torch autograd of
  the full-batch loss at the same params (`reference_grads`), as ||got - ref|| over
  ||ref|| of the whole param;
- the global grad norm `opt.step()` returns (before clipping) against that reference's norm;
- the params after the step against one process trained on the whole batch.
Adam is scale-invariant and these steps never clip, so the params alone would not see a
gradient scaled by a constant (2x, 1/dp missing, 1/micro-batches missing); the grads and the
norm do (`test_a_planted_bug_fails_the_comparison`).

Tolerances, from the largest error measured (max over dp 2 and 4, every case, rank and
step; rerun with PENTATRON_MEASURE=1 to print them), on 2026-12-05 and, for the grads,
2026-12-07:
- fp32: grads GRAD_RTOL = 2e-6 (measured 4.4e-7); grad norms NORM_RTOL = 1e-6 relative
  (measured 1.3e-7); params PARAM_TOL = 3e-7 absolute and relative (measured 3.0e-8
  absolute).
- bf16 (bf16 params and compute, fp32 grad reduction and main params): grads and grad
  norms against the same bf16 computation of the whole batch, the grads BF16_GRAD_RTOL =
  1.5e-2 (measured 5.7e-3: each rank's bf16 partial sums are rounded apart; 2.6x; against
  fp32 they would differ by 1.7e-2, bf16's own error), the norms BF16_NORM_RTOL = 1e-2
  (measured 1.1e-3; 9x); params vs the fp32 reference BF16_PARAM_TOL = 1e-2 (measured
  3.9e-3; 2.6x). Every bf16 param must have moved from its initial value
  by more than 3 x BF16_PARAM_TOL (measured at least 3.9e-2), so an untrained run, or one
  at half the learning rate, fails.
- fp16 (fp16 params and compute, dynamic loss scale 2^12, fp32 grad reduction and main
  params, distributed optimizer, 2 micro-batches) vs fp32: grads FP16_GRAD_RTOL = 1e-2
  (measured 1.6e-3; 6x), grad norms FP16_NORM_RTOL = 1e-3 (measured 1.5e-4; 6.6x), params
  FP16_PARAM_TOL = 3e-3 (measured 4.5e-4; 6.7x); the grads compared are the reduced ones
  divided by the loss scale, every step ran at scale 2^12 (none skipped), and every param
  moved by more than 3 x FP16_PARAM_TOL (measured at least 4.1e-2).
"""

import contextlib
import math
import os

import pytest
import torch

from pentatron.optim import (
    DDPConfig,
    DistributedDataParallel,
    OptimizerConfig,
    finalize_model_grads,
    get_optimizer,
)
from pentatron.parallel_state import ParallelConfig, comm, initialize_model_parallel

STEPS, BATCH, LR, WD, CLIP = 5, 16, 1e-2, 0.1, 1.0
GRAD_RTOL, NORM_RTOL, PARAM_TOL = 2e-6, 1e-6, 3e-7
BF16_GRAD_RTOL, BF16_NORM_RTOL, BF16_PARAM_TOL = 1.5e-2, 1e-2, 1e-2
FP16_GRAD_RTOL, FP16_NORM_RTOL, FP16_PARAM_TOL = 1e-2, 1e-3, 3e-3
MEASURE = os.environ.get("PENTATRON_MEASURE") == "1"  # print the measured errors


def make_model(dtype=torch.float32):
    torch.manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.LayerNorm(16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 4),
    )
    return model.to(dtype)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def reference(steps=STEPS):
    """One process, whole batch, torch AdamW, no weight decay on biases and norm weights."""
    model = make_model()
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias") and p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or p.dim() == 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}], lr=LR
    )
    out = []
    for step in range(steps):
        x, y = batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


_REF_GRADS: dict = {}


def reference_grads(params, step, dtype=torch.float32):
    """Plain torch: autograd of the whole batch's mean loss at `params` (a list), the model
    and batch in `dtype` as the run has them (the grads returned in fp32); cached by value,
    as the ranks of a run hold the same params."""
    key = (step, dtype, tuple(p.numpy().tobytes() for p in params))
    if key not in _REF_GRADS:
        _REF_GRADS[key] = _autograd(params, step, dtype)
    return _REF_GRADS[key]


def _autograd(params, step, dtype):
    model = make_model(dtype)
    with torch.no_grad():
        for p, v in zip(model.parameters(), params):
            p.copy_(v)
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y.to(dtype).float())
    loss.backward()
    return [p.grad.float() for p in model.parameters()]


def build(case, grid):
    dtype = case.get("dtype", torch.float32)
    ddp_cfg = DDPConfig(
        overlap_grad_reduce=case.get("overlap", False),
        bucket_size=case.get("bucket_size"),
        use_distributed_optimizer=case.get("dist_opt", False),
        overlap_param_gather=case.get("overlap_param_gather", False),
        grad_reduce_in_fp32=True,
    )
    model = DistributedDataParallel(ddp_cfg, make_model(dtype), grid=grid)
    opt_cfg = OptimizerConfig(
        lr=LR,
        weight_decay=WD,
        clip_grad=CLIP,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        initial_loss_scale=2.0**12,  # fp16 only: the scale the loss is multiplied by
        use_distributed_optimizer=case.get("dist_opt", False),
    )
    return model, get_optimizer(opt_cfg, [model], grid=grid)


def microbatch_loss(loss, micro):
    """A micro-batch's share of the step's loss: the mean over micro-batches."""
    return loss / micro


def optimizer_grads(model, opt):
    """What the optimizer steps on, as (param index, flat offset in the param, fp32 grad):
    each main param's grad is a view of the reduced grad buffer (sharded: this rank's part)."""
    index = {p: i for i, p in enumerate(model.module.parameters())}
    out = []
    for mp in opt.main_params:
        buffer = model.param_to_buffer[mp.model_param]
        start, _ = buffer.param_range[mp.model_param]
        at = (mp.grad.data_ptr() - buffer.grad_data.data_ptr()) // buffer.grad_data.element_size()
        grad = mp.grad.detach().float() / opt.get_loss_scale()  # fp16: the scaled grad
        out.append((index[mp.model_param], at - start, grad))
    return out


def train_step(model, opt, grid, step, micro, dtype, ledgers=None, grads=None):
    x, y = batch(step)
    d, r = grid.size("dp"), grid.rank("dp")
    xs, ys = x.chunk(d)[r].to(dtype), y.chunk(d)[r].to(dtype)
    for i, (xm, ym) in enumerate(zip(xs.chunk(micro), ys.chunk(micro))):
        last = i == micro - 1
        with comm.trace() as ledger:
            ctx = torch.enable_grad() if last else model.no_sync()
            with ctx:
                loss = torch.nn.functional.mse_loss(model(xm).float(), ym.float())
                opt.scale_loss(microbatch_loss(loss, micro)).backward()
            if last:
                finalize_model_grads([model], grid=grid)
        if ledgers is not None:
            ledgers.append(len(ledger.records))
    if grads is not None:
        grads.append(optimizer_grads(model, opt))
    result = opt.step()
    opt.zero_grad()
    return result


# Bugs the comparison must see, each planted in the real code for one run:
#   grad_x2 / grad_x0.5: every reduced grad scaled (by `finish_grad_sync`);
#   no_microbatch_average: the 1/micro-batches factor dropped from the loss;
#   dp_sum: the grad buffers sum over dp instead of averaging.
PLANTS = ("grad_x2", "grad_x0.5", "no_microbatch_average", "dp_sum")


def _planted(plant):
    """A context that plants `plant` (one of PLANTS) by patching the code that owns it."""
    import sys
    from unittest import mock

    from pentatron.optim.distributed import ddp

    if plant is None:
        return contextlib.nullcontext()
    if plant in ("grad_x2", "grad_x0.5"):
        factor = 2.0 if plant == "grad_x2" else 0.5
        finish = ddp.DistributedDataParallel.finish_grad_sync

        def finish_scaled(self):
            finish(self)
            self.scale_gradients(factor)

        return mock.patch.object(ddp.DistributedDataParallel, "finish_grad_sync", finish_scaled)
    if plant == "no_microbatch_average":
        return mock.patch.object(sys.modules[__name__], "microbatch_loss", lambda loss, m: loss)
    if plant == "dp_sum":
        buffer = ddp.ParamAndGradBuffer

        def summing(*a, **kw):
            kw["gradient_scaling_factor"], kw["reduce_op"] = 1.0, torch.distributed.ReduceOp.SUM
            return buffer(*a, **kw)

        return mock.patch.object(ddp, "ParamAndGradBuffer", summing)
    raise ValueError(f"plant {plant!r}: one of {PLANTS}")


def run_cases(cases, steps=STEPS, plant=None):
    grid = initialize_model_parallel(ParallelConfig())
    out = []
    with _planted(plant):
        for case in cases:
            model, opt = build(case, grid)
            dtype = case.get("dtype", torch.float32)
            init = [p.detach().float().clone() for p in model.module.parameters()]
            params, ledgers, grads, norms, scales = [], [], [], [], []
            for step in range(steps):
                result = train_step(
                    model, opt, grid, step, case.get("micro", 1), dtype, ledgers, grads
                )
                norms.append(result.grad_norm)
                scales.append(result.loss_scale)
                model.finish_param_sync()
                params.append([p.detach().float().clone() for p in model.module.parameters()])
            out.append(
                {
                    "init": init,
                    "params": params,
                    "ledgers": ledgers,
                    "grads": grads,
                    "norms": norms,
                    "scales": scales,
                }
            )
    return out


def check_against_reference(case, got, ref, what, errors=None):
    """Raise AssertionError where `got` (one rank's run of `case`) leaves the tolerances."""
    grad_rtol, norm_rtol, param_tol = {
        torch.bfloat16: (BF16_GRAD_RTOL, BF16_NORM_RTOL, BF16_PARAM_TOL),
        torch.float16: (FP16_GRAD_RTOL, FP16_NORM_RTOL, FP16_PARAM_TOL),
    }.get(case.get("dtype"), (GRAD_RTOL, NORM_RTOL, PARAM_TOL))
    errors = {} if errors is None else errors
    for step in range(len(got["params"])):
        before = got["init"] if step == 0 else got["params"][step - 1]
        # bf16: the grads of the same bf16 computation on the whole batch (what the ranks
        # split); fp16's reference stays fp32 (unscaled fp16 grads would underflow)
        bf16 = case.get("dtype") == torch.bfloat16
        ref_grads = reference_grads(before, step, torch.bfloat16 if bf16 else torch.float32)
        for index, offset, grad in got["grads"][step]:
            full = ref_grads[index]
            expect = full.reshape(-1)[offset : offset + grad.numel()]
            err = float((grad.reshape(-1) - expect).norm() / full.norm())
            errors["grad"] = max(errors.get("grad", 0.0), err)
            if err > grad_rtol:
                raise AssertionError(
                    f"grads differ: {what} step {step} param {index}[{offset}:]: "
                    f"||got - ref|| / ||ref of the whole param|| = {err:.3g} > {grad_rtol}"
                )
        ref_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in ref_grads))
        err = abs(got["norms"][step] / ref_norm - 1)
        errors["norm"] = max(errors.get("norm", 0.0), err)
        if err > norm_rtol:
            raise AssertionError(
                f"grad norms differ: {what} step {step}: {got['norms'][step]} vs "
                f"{ref_norm} (rel {err:.3g} > {norm_rtol})"
            )
        for a, b in zip(got["params"][step], ref[step]):
            errors["param"] = max(errors.get("param", 0.0), float((a - b).abs().max()))
            torch.testing.assert_close(
                a, b, atol=param_tol, rtol=param_tol, msg=f"params differ: {what} step {step}"
            )
    return errors


CASES = [
    dict(),
    dict(overlap=True, bucket_size=100),
    dict(overlap=True, bucket_size=1),
    dict(overlap=True, bucket_size=10_000),
    dict(micro=2),
    dict(overlap=True, bucket_size=200, micro=2),
    dict(dist_opt=True),
    dict(dist_opt=True, overlap=True, bucket_size=150, micro=2),
    dict(dist_opt=True, overlap=True, bucket_size=150, overlap_param_gather=True),
    dict(dtype=torch.bfloat16),
    dict(dtype=torch.bfloat16, dist_opt=True, overlap=True, bucket_size=300),
    dict(dtype=torch.float16, dist_opt=True, overlap=True, bucket_size=300, micro=2),
]


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.parametrize("world", [2, 4])
def test_parity_with_single_process(distributed, ref, world):
    results = distributed.run(world, run_cases, CASES)
    measured: dict = {"fp32": {}, "bf16": {}, "fp16": {}}
    for case_index, case in enumerate(CASES):
        kind = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(case.get("dtype"), "fp32")
        for rank in range(world):
            got = results[rank][case_index]
            what = f"{case} rank {rank}"
            check_against_reference(case, got, ref, what, measured[kind])
            if kind == "fp16":  # the loss was scaled, and no step overflowed
                assert got["scales"] == [2.0**12] * STEPS, (what, got["scales"])
            if kind != "fp32":  # it trained: every param moved by much more than the tolerance
                tol = BF16_PARAM_TOL if kind == "bf16" else FP16_PARAM_TOL
                for i, (a, b) in enumerate(zip(got["params"][-1], got["init"])):
                    moved = float((a - b).abs().max())
                    measured[kind]["moved"] = min(measured[kind].get("moved", 1.0), moved)
                    assert moved > 3 * tol, f"{what} param {i} moved {moved}"
            micro = case.get("micro", 1)
            # grad accumulation: only the last micro-batch of each step communicates
            ledgers = got["ledgers"]
            for step in range(STEPS):
                per_step = ledgers[step * micro : (step + 1) * micro]
                assert per_step[:-1] == [0] * (micro - 1) and per_step[-1] > 0, (case, ledgers)
    if MEASURE:
        print(f"\nworld {world} measured max errors: {measured}")


def test_bf16_actually_differs_from_fp32(distributed, ref):
    """The bf16 tolerance is not vacuous: bf16 params are not bit-equal to fp32 ones."""
    got = distributed.run(2, run_cases, [dict(dtype=torch.bfloat16)])[0][0]
    assert any(not torch.equal(a, b) for a, b in zip(got["params"][-1], ref[-1]))
    assert all((a - b).abs().max() < BF16_PARAM_TOL for a, b in zip(got["params"][-1], ref[-1]))


PLANT_CASE = dict(dist_opt=True, overlap=True, bucket_size=150, micro=2)
PLANT_STEPS = 2


@pytest.mark.parametrize("plant", [None, *PLANTS])
def test_a_planted_bug_fails_the_comparison(distributed, ref, plant):
    """None: the same short run without a bug passes, so each failure is the bug's."""
    per_rank = distributed.run(2, run_cases, [PLANT_CASE], PLANT_STEPS, plant)
    for rank, (got,) in enumerate(per_rank):
        if plant is None:
            check_against_reference(PLANT_CASE, got, ref, f"rank {rank}")
            continue
        with pytest.raises(AssertionError, match="grads differ"):
            check_against_reference(PLANT_CASE, got, ref, f"{plant} rank {rank}")


def _build_with_wrong_dtype(flag):
    from pentatron.optim import OptimConfigError

    grid = initialize_model_parallel(ParallelConfig())
    model = DistributedDataParallel(DDPConfig(), make_model(), grid=grid)  # fp32 params
    try:
        get_optimizer(OptimizerConfig(**{flag: True}), [model], grid=grid)
    except OptimConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("flag", ["bf16", "fp16"])
def test_bf16_or_fp16_refuses_a_model_of_another_dtype(distributed, flag):
    """bf16=True / fp16=True are read: fp32 params under them fail before training."""
    message = distributed.run(1, _build_with_wrong_dtype, flag)[0]
    assert message is not None and f"{flag}=True" in message and "torch.float32" in message
    assert "fix" in message
