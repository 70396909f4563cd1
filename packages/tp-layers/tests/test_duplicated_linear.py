"""DuplicatedLinear at tp 2 and 4 against `torch.nn.functional.linear` on one process.

Each rank builds the layer from the same seed; its weight must equal the master weight a
column layer draws (so every tp rank holds the same copy, and any t gives the tp=1
weights). Outputs and the input, weight and bias grads, fp32 (rtol 1e-5, atol 1e-6: only
the order of sums differs):
- without SP every rank takes the whole `[s, b, in]` and must hold the whole dW, with no
  collective at all;
- with SP each rank takes its `[s/t, b, in]` tokens: its output and input grad are its
  slice of the reference, and after `sync_sequence_parallel_grads` (the sum over tp that
  the optimizer's finalize step does for the params it marks) dW and db are the whole
  batch's. Without that sum each rank would hold only its tokens' share: the planted run
  skips it and must differ.
- gradient-accumulation fusion puts dW into `main_grad` and leaves `.grad` unset.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pentatron.parallel_state import ParallelConfig, comm, initialize_model_parallel
from pentatron.tp_layers import (
    ColumnParallelLinear,
    DuplicatedLinear,
    init_method_normal,
    sync_sequence_parallel_grads,
)

TOL = {"rtol": 1e-5, "atol": 1e-6}
S, B, IN, OUT = 8, 2, 12, 5


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _case(tp, sp, sync=True, fused=False):
    grid = initialize_model_parallel(ParallelConfig(tp=tp))
    group = grid.group("tp")
    n, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(7)
    layer = DuplicatedLinear(
        IN,
        OUT,
        tp_group=group,
        bias=True,
        init_method=init_method_normal(0.5),
        sequence_parallel=sp,
    )
    weight = layer.weight.detach().clone()
    with torch.no_grad():
        layer.bias.copy_(_randn(3, OUT))
    if fused:
        layer.weight.main_grad = torch.zeros_like(layer.weight)
    x, dy = _randn(1, S, B, IN), _randn(2, S, B, OUT)
    xl = (x.chunk(n)[r] if sp else x).clone().requires_grad_()
    with comm.trace() as ledger:
        y, _ = layer(xl)
        (y * (dy.chunk(n)[r] if sp else dy)).sum().backward()
    if sync:
        sync_sequence_parallel_grads(layer, group)
    # the reference: plain F.linear of the whole batch
    xr = x.clone().requires_grad_()
    wr = weight.clone().requires_grad_()
    br = layer.bias.detach().clone().requires_grad_()
    yr = F.linear(xr, wr, br)
    (yr * dy).sum().backward()
    return {
        "rank": r,
        "n": n,
        "weights_equal": [torch.equal(w, weight) for w in _all_gathered(weight, group)],
        "y": (y.detach(), yr.detach().chunk(n)[r] if sp else yr.detach()),
        "dx": (xl.grad, xr.grad.chunk(n)[r] if sp else xr.grad),
        "dw": (layer.weight.main_grad if fused else layer.weight.grad, wr.grad),
        "grad_unset": layer.weight.grad is None,
        "db": (layer.bias.grad, br.grad),
        "collectives": len(ledger.records),
        "marked": getattr(layer.weight, "sequence_parallel", False),
    }


def _all_gathered(t, group):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _run(tp, sp, sync=True, fused=False):
    from pentatron.parallel_state import destroy_model_parallel

    try:
        return _case(tp, sp, sync, fused)
    finally:
        destroy_model_parallel()


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_duplicated_linear_matches_one_process(distributed, tp, sp):
    for res in distributed.run(tp, _run, tp, sp):
        assert all(res["weights_equal"])  # every tp rank holds the same whole weight
        assert res["collectives"] == 0  # no communication in forward or backward
        assert res["marked"] == sp  # SP: the params' partial grads are summed over tp
        for key in ("y", "dx", "dw", "db"):
            got, want = res[key]
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, k=key: f"{k}: {m}")


def test_the_weight_is_the_master_a_column_layer_draws():
    """One process: the duplicated weight equals a ColumnParallelLinear's full weight drawn
    from the same seed and init (tp ranks draw the same master, so their copies agree)."""
    torch.manual_seed(3)
    dup = DuplicatedLinear(IN, OUT, init_method=init_method_normal(0.5))
    torch.manual_seed(3)
    col = ColumnParallelLinear(IN, OUT, init_method=init_method_normal(0.5))
    assert torch.equal(dup.weight, col.weight)
    assert dup.weight.tensor_model_parallel is False  # counted once by grad-norm clipping


def test_without_the_tp_sum_sp_weight_grads_are_partial(distributed):
    """Planted: the sum over tp skipped under SP -> each rank's dW and db hold only its
    tokens' share, and the comparison above fails."""
    for res in distributed.run(2, _run, 2, True, False):
        for key in ("dw", "db"):
            got, want = res[key]
            assert not torch.allclose(got, want, **TOL), key


def test_fused_accumulation_fills_main_grad(distributed):
    for res in distributed.run(2, _run, 2, True, True, True):
        assert res["grad_unset"]
        got, want = res["dw"]
        torch.testing.assert_close(got, want, **TOL)


def _sync_in_buckets(limit):
    from pentatron.parallel_state import destroy_model_parallel
    from pentatron.tp_layers import mark_sequence_parallel

    grid = initialize_model_parallel(ParallelConfig(tp=2))
    try:
        r = grid.rank("tp")
        module = torch.nn.Module()
        sizes = (3, 4, 10, 2, 2, 1)
        for i, n in enumerate(sizes):
            p = torch.nn.Parameter(torch.zeros(n))
            p.grad = _randn(10 * i + r, n)  # each rank's own partial grad
            mark_sequence_parallel(p)
            module.register_parameter(f"p{i}", p)
        module.register_parameter("unmarked", torch.nn.Parameter(torch.zeros(5)))
        module.unmarked.grad = _randn(99 + r, 5)
        want = [_randn(10 * i, n) + _randn(10 * i + 1, n) for i, n in enumerate(sizes)]
        with comm.trace() as ledger:
            count = sync_sequence_parallel_grads(module, grid.group("tp"), bucket_elements=limit)
        got = [getattr(module, f"p{i}").grad for i in range(len(sizes))]
        return count, [r.elements for r in ledger.records], got, want, module.unmarked.grad, r
    finally:
        destroy_model_parallel(grid)


@pytest.mark.parametrize(("limit", "calls"), [(6, [3, 4, 10, 5]), (1 << 24, [22])])
def test_sequence_parallel_grads_are_summed_in_bounded_buckets(distributed, limit, calls):
    """The tp sum of the marked grads joins at most `limit` elements per collective (a
    larger grad goes alone, in place); every marked grad is the sum of the ranks', the
    unmarked one is left as it was."""
    for count, elements, got, want, unmarked, r in distributed.run(2, _sync_in_buckets, limit):
        assert count == 6 and elements == calls
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
        assert torch.equal(unmarked, _randn(99 + r, 5))
