"""Each mapping's forward and backward against its closed form, at tp = 2 and 4.

Rank r's data is `(r + 1) * X` (or its r-th chunk), so every expected value is a plain
torch expression over the known per-rank inputs, with no collective in the reference.
"""

import pytest
import torch
import torch.distributed as dist

from pentatron.parallel_state import comm
from pentatron.tp_layers import (
    all_to_all,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

EXACT = {"rtol": 0.0, "atol": 0.0}  # sums of small integers in fp64: exact


def _run(fn, x, grad):
    """Forward `fn(leaf)`, backward with `grad`: (output, input grad, ledger records)."""
    leaf = x.clone().requires_grad_()
    with comm.trace() as ledger:
        y = fn(leaf)
        y.backward(grad)
    return y.detach(), leaf.grad, [(r.op, r.elements) for r in ledger.records]


def _data(n, shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-5, 6, shape, generator=g).double()


def _mapping_checks():
    n, r = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    X, G = _data(n, (2 * n, 3, 2 * n), 0), _data(n, (2 * n, 3, 2 * n), 1)
    scale = float(r + 1)
    total = n * (n + 1) / 2
    done = []

    def check(name, got, want):
        torch.testing.assert_close(got, want, **EXACT, msg=lambda m: f"{name}: {m}")
        done.append(name)

    y, gx, recs = _run(lambda t: copy_to_tensor_model_parallel_region(t, group), X, scale * G)
    check("copy_to fwd", y, X)
    check("copy_to bwd", gx, total * G)
    assert recs == [("all_reduce", X.numel())], recs

    y, gx, recs = _run(lambda t: reduce_from_tensor_model_parallel_region(t, group), scale * X, G)
    check("reduce_from fwd", y, total * X)
    check("reduce_from bwd", gx, G)
    assert recs == [("all_reduce", X.numel())], recs

    shard_g = G.chunk(n, -1)[r]
    y, gx, _ = _run(lambda t: scatter_to_tensor_model_parallel_region(t, group), X, shard_g)
    check("scatter_to_tp fwd", y, X.chunk(n, -1)[r])
    check("scatter_to_tp bwd", gx, G)  # rank q sent back chunk q of G

    y, gx, _ = _run(
        lambda t: gather_from_tensor_model_parallel_region(t, group), X.chunk(n, -1)[r], G
    )
    check("gather_from_tp fwd", y, X)
    check("gather_from_tp bwd", gx, G.chunk(n, -1)[r])

    y, gx, _ = _run(lambda t: scatter_to_sequence_parallel_region(t, group), X, G.chunk(n)[r])
    check("scatter_to_sp fwd", y, X.chunk(n)[r])
    check("scatter_to_sp bwd", gx, G)

    y, gx, recs = _run(
        lambda t: gather_from_sequence_parallel_region(t, group), X.chunk(n)[r], scale * G
    )
    check("gather_from_sp fwd", y, X)
    check("gather_from_sp bwd (reduce-scatter)", gx, total * G.chunk(n)[r])
    assert [op for op, _ in recs] == ["all_gather", "reduce_scatter"], recs

    y, gx, recs = _run(
        lambda t: gather_from_sequence_parallel_region(t, group, False), X.chunk(n)[r], G
    )
    check("gather_from_sp bwd (split)", gx, G.chunk(n)[r])
    assert [op for op, _ in recs] == ["all_gather"], recs

    y, gx, _ = _run(
        lambda t: reduce_scatter_to_sequence_parallel_region(t, group), scale * X, G.chunk(n)[r]
    )
    check("reduce_scatter_to_sp fwd", y, total * X.chunk(n)[r])
    check("reduce_scatter_to_sp bwd", gx, G)
    _all_to_all_checks(n, r, group, check)
    return done


def _all_to_all_checks(n, r, group, check):
    # Uneven splits: rank i sends (i + j + 1) rows of width 2 to rank j, row values encode
    # (sender, receiver, row index) so the expected layout is written down directly.
    def rows(src, dst, count):
        return torch.tensor([[100.0 * src + 10 * dst + k, -1.0] for k in range(count)])

    send = [r + j + 1 for j in range(n)]
    recv = [i + r + 1 for i in range(n)]
    x = torch.cat([rows(r, j, send[j]) for j in range(n)]).double()
    want = torch.cat([rows(i, r, recv[i]) for i in range(n)]).double()
    grad = 2.0 * want + 1.0  # the grad of row k comes back to the row it was sent from
    y, gx, _ = _run(lambda t: all_to_all(t, group, recv, send), x, grad)
    check("all_to_all fwd (uneven)", y, want)
    check("all_to_all bwd (uneven)", gx, 2.0 * x + 1.0)
    xe = torch.arange(4.0 * n).double().view(2 * n, 2) + 1000 * r
    y, gx, _ = _run(lambda t: all_to_all(t, group), xe, torch.ones_like(xe) * r)
    want_e = torch.cat(
        [(torch.arange(4.0 * n).double().view(2 * n, 2) + 1000 * i).chunk(n)[r] for i in range(n)]
    )
    check("all_to_all fwd (even)", y, want_e)
    check(
        "all_to_all bwd (even)",
        gx,
        torch.cat([torch.full((2, 2), float(j)) for j in range(n)]).double(),
    )


EXPECTED = 19


@pytest.mark.parametrize("world", [2, 4])
def test_mappings_forward_and_backward(distributed, world):
    results = distributed.run(world, _mapping_checks)
    for done in results:
        assert len(done) == EXPECTED and len(set(done)) == EXPECTED, done


def _single_rank_identity():
    """A group of one rank: every mapping is the identity and issues no collective."""
    solos = [dist.new_group([q]) for q in range(dist.get_world_size())]
    solo = solos[dist.get_rank()]
    x = torch.randn(4, 2, 6)
    with comm.trace() as ledger:
        outs = [
            copy_to_tensor_model_parallel_region(x, solo),
            reduce_from_tensor_model_parallel_region(x, solo),
            gather_from_sequence_parallel_region(x, solo),
            reduce_scatter_to_sequence_parallel_region(x, solo),
        ]
    return all(torch.equal(o, x) for o in outs), len(ledger.records)


def test_group_of_one_is_identity(distributed):
    assert distributed.run(2, _single_rank_identity) == [(True, 0), (True, 0)]
