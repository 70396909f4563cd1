"""Real process groups at world size 8: an all_reduce over each group sums its members."""

import pytest
import torch
import torch.distributed as dist

from pentatron.parallel_state import (
    FAMILIES,
    GridLayout,
    ParallelConfig,
    accessors,
    comm,
    initialize_model_parallel,
)

LAYOUTS = [
    dict(tp=2, pp=2),  # tp2-pp2-dp2
    dict(tp=2, pp=2, ep=2),  # tp2-ep2-pp2 (etp = tp = 2, edp = 1)
    dict(tp=2, cp=2, ep=2, etp=1),
    dict(tp=1, pp=4, ep=2, order="tp-cp-ep-dp-pp"),
    dict(tp=2, pp=2, order="tp-pp-dp"),
    dict(pp=2, vpp=2, cp=2),
]


def _sum_over_every_group(kwargs):
    grid = initialize_model_parallel(ParallelConfig(**kwargs))
    out = {}
    for name in FAMILIES:
        group = grid.group(name)
        if group is None:
            out[name] = None
            continue
        x = torch.tensor([float(dist.get_rank())], dtype=torch.float64)
        comm.all_reduce(x, group=group)
        out[name] = (x.item(), grid.ranks(name), grid.rank(name), grid.size(name))
    out["accessors"] = (
        accessors.get_tensor_model_parallel_rank(),
        accessors.get_data_parallel_world_size(with_context_parallel=True),
        accessors.get_expert_model_parallel_world_size(),
        accessors.is_pipeline_first_stage(),
        accessors.is_pipeline_last_stage(),
        grid.next_pipeline_rank,
        grid.prev_pipeline_rank,
    )
    return out


@pytest.mark.parametrize("kwargs", LAYOUTS, ids=lambda k: "-".join(f"{a}{b}" for a, b in k.items()))
def test_all_reduce_over_each_group(distributed, kwargs):
    results = distributed.run(8, _sum_over_every_group, kwargs)
    layout = GridLayout(ParallelConfig(**kwargs).resolve(8))
    for rank, out in enumerate(results):
        for name in FAMILIES:
            expected = layout.ranks(name, rank)
            if expected is None:
                assert out[name] is None, (rank, name)
                continue
            total, ranks, index, size = out[name]
            assert ranks == expected
            assert total == float(sum(expected)), (rank, name)
            assert (index, size) == (expected.index(rank), len(expected))
        tp_rank, dpcp, ep, first, last, nxt, prv = out["accessors"]
        pp_group = layout.ranks("pp", rank)
        assert tp_rank == layout.ranks("tp", rank).index(rank)
        assert dpcp == len(layout.ranks("dp-cp", rank))
        assert ep == kwargs.get("ep", 1)
        assert first == (pp_group[0] == rank) and last == (pp_group[-1] == rank)
        i = pp_group.index(rank)
        assert nxt == pp_group[(i + 1) % len(pp_group)] and prv == pp_group[i - 1]


def _default_grid_is_cleared_between_calls():
    from pentatron.parallel_state import model_parallel_is_initialized

    return model_parallel_is_initialized()


def test_worker_state_is_reset_between_calls(distributed):
    distributed.run(8, _sum_over_every_group, LAYOUTS[0])
    assert distributed.run(8, _default_grid_is_cleared_between_calls) == [False] * 8


def _two_grids():
    a = initialize_model_parallel(ParallelConfig(tp=2), set_default=False)
    b = initialize_model_parallel(ParallelConfig(tp=4), set_default=False)
    x = torch.ones(1)
    comm.all_reduce(x, group=a.group("tp"))
    y = torch.ones(1)
    comm.all_reduce(y, group=b.group("tp"))
    from pentatron.parallel_state import destroy_model_parallel

    destroy_model_parallel(a)
    destroy_model_parallel(b)
    return x.item(), y.item()


def test_two_grids_coexist_without_default(distributed):
    assert distributed.run(4, _two_grids) == [(2.0, 4.0)] * 4


def _twin(_=None):
    """tp2-pp2: the pp twin is a distinct group over the pp ranks; a message on one group
    does not match a receive on the other; errors name it."""
    from datetime import timedelta

    grid = initialize_model_parallel(ParallelConfig(tp=2, pp=2, timeout=timedelta(seconds=2)))
    twin = grid.twin_group("pp")
    assert twin is grid.twin_group("pp")  # cached: no second new_group
    assert twin is not grid.group("pp")
    x = torch.tensor([float(dist.get_rank())], dtype=torch.float64)
    comm.all_reduce(x, group=twin)
    peer = grid.ranks("pp")[1 - grid.rank("pp")]
    # Both ranks send one tensor on each group, twin first; the receives are posted in the
    # other order: each matches its own group's send, so the values do not swap.
    sends = [
        comm.isend(torch.tensor([10.0 + dist.get_rank()]), peer, group=twin),
        comm.isend(torch.tensor([20.0 + dist.get_rank()]), peer, group=grid.group("pp")),
    ]
    on_pp, on_twin = torch.zeros(1), torch.zeros(1)
    comm.irecv(on_pp, peer, group=grid.group("pp")).wait()
    comm.irecv(on_twin, peer, group=twin).wait()
    for s in sends:
        s.wait()
    error = ""
    if grid.rank("pp") == 0:  # a receive no one sends: the named timeout
        try:
            comm.irecv(torch.zeros(1), peer, group=twin).wait()
        except comm.CollectiveError as e:
            error = str(e)
    return x.item(), sorted(grid.ranks("pp")), on_pp.item(), on_twin.item(), peer, error


def test_twin_group(distributed):
    results = distributed.run(4, _twin)
    distributed.pool(4).close()  # the abandoned receive: start the next test afresh
    for got in results:
        total, ranks, on_pp, on_twin, peer, _ = got
        assert total == sum(ranks)
        assert (on_pp, on_twin) == (20.0 + peer, 10.0 + peer)
    assert sum("'pp-twin'" in r[-1] for r in results) == 2, [r[-1] for r in results]


def _hierarchical_cp():
    grid = initialize_model_parallel(ParallelConfig(tp=2, cp=4, hierarchical_cp=(2, 2)))
    sums = []
    for group in accessors.get_hierarchical_context_parallel_groups():
        x = torch.tensor([float(dist.get_rank())], dtype=torch.float64)
        comm.all_reduce(x, group=group)
        sums.append((x.item(), dist.get_process_group_ranks(group), comm.group_name(group)))
    return sums, grid.ranks("cp")


def test_hierarchical_cp_groups(distributed):
    """Each level's group holds the ranks of GridLayout.hierarchical_cp and sums over them."""
    results = distributed.run(8, _hierarchical_cp)
    for rank, (sums, cp_ranks) in enumerate(results):
        assert len(sums) == 2
        (a2a_sum, a2a, name0), (p2p_sum, p2p, name1) = sums
        assert (name0, name1) == ("hcp0", "hcp1")
        i = cp_ranks.index(rank)
        assert a2a == cp_ranks[i - i % 2 :][:2]  # consecutive cp members
        assert p2p == cp_ranks[i % 2 :: 2]  # members 2 apart
        assert (a2a_sum, p2p_sum) == (sum(a2a), sum(p2p))
