"""comm's reduce-scatter, all-gather and all-reduce on gloo run as gloo all-to-all + a local
reduction (`gloo_collectives`): the same results as torch's own gloo collectives (the
independent reference here), reductions in rank order, and the choice of path pinned by
counting the calls that reach torch."""

import time
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from pentatron.parallel_state import comm

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)
OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN)


def _data(shape, dtype, salt):
    """Integer values (exact in every dtype and any summation order), distinct per rank."""
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + salt)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


def _against_torch():
    """Every case through comm and through torch's own collective; the pairs of results."""
    n = dist.get_world_size()
    cases = []
    salt = 0
    for dtype in DTYPES:
        for op in OPS:
            # numel 1, not a multiple of n, 0-dim, multi-dim
            for shape in ((1,), (2 * n + 1,), (), (3, 2, 5)):
                salt += 1
                x = _data(shape, dtype, salt)
                ref = x.clone()
                dist.all_reduce(ref, op=op)
                comm.all_reduce(x, op=op)
                cases.append((f"all_reduce {dtype} {op} {shape}", x, ref))
            for rows in (1, 3):
                salt += 1
                inp = _data((n * rows, 4), dtype, salt)
                out, ref = torch.empty(rows, 4, dtype=dtype), torch.empty(rows, 4, dtype=dtype)
                dist.reduce_scatter_tensor(ref, inp, op=op)
                comm.reduce_scatter_tensor(out, inp, op=op)
                cases.append((f"reduce_scatter {dtype} {op} rows={rows}", out, ref))
        salt += 1
        inp = _data((3, 2), dtype, salt)
        out, ref = torch.empty(3 * n, 2, dtype=dtype), torch.empty(3 * n, 2, dtype=dtype)
        dist.all_gather_into_tensor(ref, inp)
        comm.all_gather_into_tensor(out, inp)
        cases.append((f"all_gather {dtype}", out, ref))
    # a non-contiguous all-reduce operand and reduce-scatter output
    salt += 1
    x = _data((4, 2 * n), torch.float32, salt).t()
    ref = x.clone()
    dist.all_reduce(ref)
    comm.all_reduce(x)
    cases.append(("all_reduce non-contiguous", x, ref))
    inp = _data((2 * n, 3), torch.float32, salt + 1)
    out, ref = torch.empty(3, 2).t(), torch.empty(2, 3)
    dist.reduce_scatter_tensor(ref, inp)
    comm.reduce_scatter_tensor(out, inp)
    cases.append(("reduce_scatter non-contiguous output", out, ref))
    return [
        (name, got.tolist(), want.tolist(), got.dtype == want.dtype) for name, got, want in cases
    ]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_results_equal_torchs_gloo_collectives(distributed, world):
    for rank_cases in distributed.run(world, _against_torch):
        for name, got, want, same_dtype in rank_cases:
            assert same_dtype and got == want, name


def _rank_order_sums():
    """Random fp32: the reduction is rank 0's part + rank 1's + ... in that order, bit for
    bit, and an all-reduce leaves every rank the same bits."""
    n, me = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(7 + me)
    x = torch.randn(5 * n, generator=g) * 10 ** torch.randint(-3, 4, (5 * n,), generator=g)
    every = torch.empty(n * x.numel())
    dist.all_gather_into_tensor(every, x)  # torch's, to build the reference by hand
    parts = every.view(n, -1)
    in_order = parts[0].clone()
    for j in range(1, n):
        in_order += parts[j]
    shard = torch.empty(5)
    comm.reduce_scatter_tensor(shard, x)
    reduced = x.clone()
    comm.all_reduce(reduced)
    return (
        torch.equal(shard, in_order.view(n, 5)[me]),
        torch.equal(reduced, in_order),
        reduced.tolist(),
    )


def test_reductions_are_in_rank_order_and_equal_on_every_rank(distributed):
    results = distributed.run(4, _rank_order_sums)
    assert all(shard_ok and all_ok for shard_ok, all_ok, _ in results)
    assert all(r[2] == results[0][2] for r in results)


def _async_handles():
    n = dist.get_world_size()
    inp = torch.arange(4.0 * n) + dist.get_rank()
    rs = torch.empty(4)
    work = comm.reduce_scatter_tensor(rs, inp, async_op=True)
    deadline = time.monotonic() + 10
    while not work.is_completed():  # polled, then read without wait(): already reduced
        assert time.monotonic() < deadline, "the reduce-scatter never reported completion"
        time.sleep(0.001)
    polled = rs.tolist()
    work.wait()  # a second completion check changes nothing
    ag = torch.empty(2 * n)
    comm.all_gather_into_tensor(ag, torch.full((2,), float(dist.get_rank())), async_op=True).wait()
    return polled, rs.tolist(), ag.tolist()


def test_async_handles_give_the_result_at_wait_or_completion(distributed):
    n = 2
    for rank, (polled, waited, gathered) in enumerate(distributed.run(n, _async_handles)):
        base = torch.arange(4.0 * n).view(n, 4)[rank] * n + sum(range(n))
        assert polled == waited == base.tolist()
        assert gathered == [float(r) for r in range(n) for _ in range(2)]


@contextmanager
def _counting():
    """Counts of the calls that reach torch: its all-to-all and the collectives comm would
    otherwise have called."""
    counts = {"all_to_all": 0, "reduce_scatter": 0, "all_gather": 0, "all_reduce": 0}

    def counted(name, fn):
        def call(*a, **kw):
            counts[name] += 1
            return fn(*a, **kw)

        return call

    with (
        mock.patch.object(dist, "all_to_all_single", counted("all_to_all", dist.all_to_all_single)),
        mock.patch.object(
            comm, "_REDUCE_SCATTER_SINGLE", counted("reduce_scatter", comm._REDUCE_SCATTER_SINGLE)
        ),
        mock.patch.object(
            comm, "_ALL_GATHER_SINGLE", counted("all_gather", comm._ALL_GATHER_SINGLE)
        ),
        mock.patch.object(dist, "all_reduce", counted("all_reduce", dist.all_reduce)),
    ):
        yield counts


def _paths():
    n = dist.get_world_size()
    seen = {}
    with _counting() as c:
        comm.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * n))
        seen["reduce_scatter"] = dict(c)
    with _counting() as c:
        comm.all_gather_into_tensor(torch.empty(2 * n), torch.ones(2))
        seen["all_gather"] = dict(c)
    with _counting() as c:
        comm.all_reduce(torch.ones(3))
        seen["all_reduce"] = dict(c)
    with _counting() as c:  # async all-reduce: torch's (see gloo_collectives.all_reduce)
        comm.all_reduce(torch.ones(3), async_op=True).wait()
        seen["all_reduce async"] = dict(c)
    with _counting() as c:  # bool: no local reduction for it
        comm.all_reduce(torch.ones(3, dtype=torch.bool), op=dist.ReduceOp.MAX)
        seen["all_reduce bool"] = dict(c)
    return seen


def test_gloo_takes_all_to_all_and_torchs_path_where_it_must(distributed):
    zero = {"all_to_all": 0, "reduce_scatter": 0, "all_gather": 0, "all_reduce": 0}
    seen = distributed.run(2, _paths)[0]
    assert seen["reduce_scatter"] == {**zero, "all_to_all": 1}
    assert seen["all_gather"] == {**zero, "all_to_all": 1}
    assert seen["all_reduce"] == {**zero, "all_to_all": 2}  # reduce-scatter + all-gather
    assert seen["all_reduce async"] == {**zero, "all_reduce": 1}
    assert seen["all_reduce bool"] == {**zero, "all_reduce": 1}


def _traced():
    n = dist.get_world_size()
    with comm.trace() as ledger:
        comm.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * n))
        comm.all_reduce(torch.ones(4))
    return [(r.op, r.elements, r.wire_bytes) for r in ledger.records]


def test_the_ledger_records_the_collective_asked_for(distributed):
    # the logical collective and its ring wire bytes, not the all-to-alls under it
    n = 4
    assert distributed.run(n, _traced)[0] == [
        ("reduce_scatter", 2 * n, (n - 1) * 2 * 4),
        ("all_reduce", 4, 2 * (n - 1) * 4),
    ]


def _mis_sized():
    n = dist.get_world_size()
    errors = []
    for call in (
        lambda: comm.reduce_scatter_tensor(torch.empty(3), torch.ones(2 * n)),
        lambda: comm.all_gather_into_tensor(torch.empty(2 * n + 1), torch.ones(2)),
    ):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_mis_sized_buffers_fail_before_any_collective(distributed):
    # every rank raises on its own (no rank waits in a collective), naming the argument
    for errors in distributed.run(2, _mis_sized):
        assert len(errors) == 2
        assert errors[0].startswith("reduce_scatter_tensor: input (4 x torch.float32)")
        assert errors[1].startswith("all_gather_into_tensor: output (5 x torch.float32)")
