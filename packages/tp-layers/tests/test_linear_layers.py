"""ColumnParallelLinear / RowParallelLinear vs the same layer at TP=1, outputs and gradients.

Each worker builds the TP=1 reference from the same seed on a one-rank group (so it is our
layer with no communication), checks that reference against `torch.nn.functional.linear`,
then checks the TP=t layer's output and input/weight/bias grads against the matching slices
of the reference. fp32, tolerance rtol=1e-5, atol=1e-6 (sums are reordered across ranks).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pentatron.parallel_state import ParallelConfig, initialize_model_parallel
from pentatron.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    init_method_normal,
    sync_sequence_parallel_grads,
)

TOL = {"rtol": 1e-5, "atol": 1e-6}
S, B, IN = 8, 2, 6  # S divides every tp size used (2, 4, 8)


def shard_of(full, dim, r, n, stride=1):
    """Rank r's part: its 1/n of each of the `stride` blocks (written independently of the
    package's own helper, so a wrong layout there cannot also be the expectation here)."""
    return torch.cat([block.chunk(n, dim)[r] for block in full.chunk(stride, dim)], dim)


def _solo_group():
    solos = [dist.new_group([q]) for q in range(dist.get_world_size())]
    return solos[dist.get_rank()]


def _close(name, got, want):
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{name}: {m}")


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _build(cls, group, seed, *args, **kw):
    """The layer, with its bias (zero-initialised) replaced by seeded random values."""
    torch.manual_seed(seed)
    layer = cls(*args, tp_group=group, init_method=init_method_normal(0.5), **kw)
    return layer


def _set_bias(layer, full_bias, sharded, stride=1):
    if layer.bias is not None:
        n, r = dist.get_world_size(layer.tp_group), dist.get_rank(layer.tp_group)
        value = shard_of(full_bias, 0, r, n, stride) if sharded else full_bias
        with torch.no_grad():
            layer.bias.copy_(value)


def _column_case(group, solo, case):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    stride, out = case.get("stride", 1), 24
    kw = {
        k: case[k]
        for k in (
            "gather_output",
            "skip_bias_add",
            "sequence_parallel",
            "async_tensor_model_parallel_allreduce",
            "regather_input",
        )
        if k in case
    }
    ref = _build(ColumnParallelLinear, solo, 7, IN, out, stride=stride)
    layer = _build(
        ColumnParallelLinear,
        group,
        7,
        IN,
        out,
        stride=stride,
        skip_weight_param_allocation=case.get("weight_at_forward", False),
        **kw,
    )
    bias = _randn(3, out)
    _set_bias(ref, bias, True)
    _set_bias(layer, bias, True, stride)
    x, dy = _randn(1, S, B, IN), _randn(2, S, B, out)

    # The reference is plain F.linear of the full master weight.
    xr = x.clone().requires_grad_()
    yr = ref(xr)[0]
    _close("reference vs F.linear", yr, F.linear(x, ref.weight, bias))
    (yr * dy).sum().backward()

    weight = layer.weight
    if case.get("weight_at_forward"):
        weight = shard_of(ref.weight.detach(), 0, r, n, stride).clone().requires_grad_()
    else:
        _close("init equals TP=1 shard", layer.weight, shard_of(ref.weight, 0, r, n, stride))
    if case.get("main_grad"):
        weight.main_grad = torch.ones_like(weight, dtype=torch.float32)
    sp = case.get("sequence_parallel", False)
    xl = (x.chunk(n)[r] if sp else x).clone().requires_grad_()
    steps = 2 if case.get("main_grad") else 1
    for _ in range(steps):
        y, b_out = layer(xl, weight) if case.get("weight_at_forward") else layer(xl)
        if case.get("skip_bias_add"):
            assert b_out is layer.bias
            y = y + b_out
        want = shard_of(yr.detach(), -1, r, n, stride)
        dy_l = shard_of(dy, -1, r, n, stride)
        if case.get("gather_output"):
            want = torch.cat([shard_of(yr.detach(), -1, q, n, stride) for q in range(n)], -1)
            dy_l = torch.cat([shard_of(dy, -1, q, n, stride) for q in range(n)], -1)
        _close("output", y, want)
        (y * dy_l).sum().backward()
    _close("input grad", xl.grad, steps * (xr.grad.chunk(n)[r] if sp else xr.grad))
    wgrad = shard_of(ref.weight.grad, 0, r, n, stride)
    if case.get("main_grad"):
        assert weight.grad is None, "fused accumulation must leave weight.grad unset"
        assert weight.main_grad.dtype == torch.float32
        _close("main_grad", weight.main_grad, 1.0 + steps * wgrad)
    else:
        _close("weight grad", weight.grad, wgrad)
    _close("bias grad", layer.bias.grad, steps * shard_of(ref.bias.grad, 0, r, n, stride))


def _row_case(group, solo, case):
    n, r = dist.get_world_size(group), dist.get_rank(group)
    hin, out = 4 * n, 5
    kw = {
        k: case[k] for k in ("input_is_parallel", "skip_bias_add", "sequence_parallel") if k in case
    }
    ref = _build(RowParallelLinear, solo, 11, hin, out)
    layer = _build(RowParallelLinear, group, 11, hin, out, **kw)
    bias = _randn(5, out)
    _set_bias(ref, bias, False)
    _set_bias(layer, bias, False)
    x, dy = _randn(1, S, B, hin), _randn(2, S, B, out)
    xr = x.clone().requires_grad_()
    yr = ref(xr)[0]
    _close("reference vs F.linear", yr, F.linear(x, ref.weight, bias))
    (yr * dy).sum().backward()
    _close("init equals TP=1 shard", layer.weight, ref.weight.chunk(n, 1)[r])
    parallel_in = case.get("input_is_parallel", False)
    sp = case.get("sequence_parallel", False)
    xl = (x.chunk(n, -1)[r] if parallel_in else x).clone().requires_grad_()
    y, b_out = layer(xl)
    if case.get("skip_bias_add"):
        y = y + b_out
    _close("output", y, yr.chunk(n)[r] if sp else yr)
    (y * (dy.chunk(n)[r] if sp else dy)).sum().backward()
    _close("input grad", xl.grad, xr.grad.chunk(n, -1)[r] if parallel_in else xr.grad)
    _close("weight grad", layer.weight.grad, ref.weight.grad.chunk(n, 1)[r])
    if sp:
        assert sync_sequence_parallel_grads(layer, group) == 1
    _close("bias grad", layer.bias.grad, ref.bias.grad)


COLUMN_CASES = [
    {},
    {"gather_output": True},
    {"skip_bias_add": True},
    {"async_tensor_model_parallel_allreduce": False},
    {"sequence_parallel": True},
    {"sequence_parallel": True, "regather_input": False},
    {"stride": 3},
    {"stride": 3, "gather_output": True},
    {"weight_at_forward": True},
    {"main_grad": True},
    {"main_grad": True, "sequence_parallel": True},
]
ROW_CASES = [
    {},
    {"input_is_parallel": True},
    {"skip_bias_add": True},
    {"input_is_parallel": True, "sequence_parallel": True},
    {"input_is_parallel": True, "sequence_parallel": True, "skip_bias_add": True},
]


def _run_cases(tp, kind_cases):
    grid = initialize_model_parallel(ParallelConfig(tp=tp))
    solo = _solo_group()
    done = []
    for kind, case in kind_cases:
        fn = _column_case if kind == "column" else _row_case
        try:
            fn(grid.group("tp"), solo, case)
        except AssertionError as exc:
            raise AssertionError(f"{kind} {case}: {exc}") from exc
        done.append((kind, tuple(sorted(case))))
    return done


ALL_CASES = [("column", c) for c in COLUMN_CASES] + [("row", c) for c in ROW_CASES]


@pytest.mark.parametrize(("world", "tp"), [(2, 2), (4, 4), (4, 2)])
def test_column_and_row_parallel_parity(distributed, world, tp):
    """All column/row cases in one call per layout (tp x dp = world)."""
    results = distributed.run(world, _run_cases, tp, ALL_CASES)
    want = [(k, tuple(sorted(c))) for k, c in ALL_CASES]
    assert all(done == want for done in results)
