"""Collectives inside torch.compile: an `async_op=True` call is issued synchronously (Dynamo
traces only synchronous collectives, as functional collectives) and its handle is already
complete, so code that overlaps a collective with other work compiles without a graph break
and computes what it computes eagerly."""

import torch
import torch.distributed as dist

from pentatron.parallel_state import ParallelConfig, comm, initialize_model_parallel
from pentatron.parallel_state.testing import RankPool


def _overlapped(x: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """all-gather, all-reduce and reduce-scatter, each started async and waited for later."""
    full = x.new_empty((2 * x.size(0), *x.shape[1:]))
    gather = comm.all_gather_into_tensor(full, x, group=group, async_op=True)
    scaled = x * 3  # work while the gather is in flight
    gather.wait()
    total = full * 2
    reduce = comm.all_reduce(total, group=group, async_op=True)
    done = reduce.wait()
    shard = torch.empty_like(x)
    comm.reduce_scatter_tensor(shard, total, group=group, async_op=True).wait()
    return total + scaled.sum(), shard, done


def _compile_and_compare():
    import torch._dynamo
    from torch._dynamo.utils import counters

    grid = initialize_model_parallel(ParallelConfig(tp=2))
    x = torch.arange(6.0).reshape(3, 2) + 10 * dist.get_rank()
    eager = _overlapped(x, grid.group("tp"))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_overlapped, backend="aot_eager")(x, grid.group("tp"))
    return (
        eager,
        compiled,
        sum(counters["graph_break"].values()),
        counters["stats"]["unique_graphs"],
    )


def test_async_collectives_compile_into_one_graph():
    """In ranks of its own, which must end cleanly: the compiled code held the tp group
    (Dynamo keeps it as a global of this module) until `shutdown` learnt to drop it, and
    the ranks exited with the group's gloo threads alive (status 3)."""
    pool = RankPool(2, timeout=120)
    try:
        results = pool.run(_compile_and_compare)
    finally:
        codes = pool.close()
    assert codes == [0, 0]
    for eager, compiled, breaks, graphs in results:
        assert (breaks, graphs) == (0, 1)
        assert eager[2] is True and compiled[2] is True  # wait() reports completion
        for e, c in zip(eager[:2], compiled[:2]):
            torch.testing.assert_close(c, e, rtol=0, atol=0)
