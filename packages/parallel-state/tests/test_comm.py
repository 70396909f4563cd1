"""Traced collectives: the ledger counts what was sent; failures name the group."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from pentatron.parallel_state import (
    CollectiveError,
    ParallelConfig,
    comm,
    initialize_model_parallel,
)


def _traced_ops():
    grid = initialize_model_parallel(ParallelConfig(tp=2))  # 4 ranks: tp2 x dp2
    tp, dp = grid.group("tp"), grid.group("dp")
    rank = dist.get_rank()
    out = {}
    with comm.trace() as ledger:
        x = torch.full((6,), float(rank))
        comm.all_reduce(x, group=tp)
        out["all_reduce"] = x.tolist()
        shard = torch.full((3,), float(rank), dtype=torch.float64)
        full = torch.empty(6, dtype=torch.float64)
        comm.all_gather_into_tensor(full, shard, group=dp)
        out["all_gather"] = full.tolist()
        rs = torch.empty(2)
        comm.reduce_scatter_tensor(rs, torch.arange(4.0) + rank, group=tp)
        out["reduce_scatter"] = rs.tolist()
        a2a = torch.empty(4)
        comm.all_to_all_single(a2a, torch.arange(4.0) + 10 * rank, group=dp)
        out["all_to_all"] = a2a.tolist()
        b = torch.full((5,), float(rank), dtype=torch.bfloat16)
        comm.broadcast(b, src=grid.ranks("tp")[0], group=tp)
        out["broadcast"] = b.float().tolist()
        peer = grid.ranks("tp")[1 - grid.rank("tp")]
        recv = torch.empty(3)
        ops = [
            comm.P2POp("send", torch.full((3,), float(rank)), peer),
            comm.P2POp("recv", recv, peer),
        ]
        for w in comm.batch_isend_irecv(ops):
            w.wait()
        out["p2p"] = recv.tolist()
    out["totals"] = ledger.totals()
    out["by_op"] = ledger.by_op()
    out["records"] = [
        (r.op, r.group, str(r.dtype), r.elements, r.bytes, r.wire_bytes) for r in ledger.records
    ]
    # outside trace(): nothing recorded
    comm.all_reduce(torch.ones(1), group=tp)
    out["after"] = len(ledger.records)
    return out


def test_trace_ledger_and_results(distributed):
    results = distributed.run(4, _traced_ops)
    for rank, out in enumerate(results):
        tp_peer = rank ^ 1
        tp_group = sorted([rank, tp_peer])
        dp_group = [rank % 2, rank % 2 + 2]
        assert out["all_reduce"] == [float(sum(tp_group))] * 6
        assert out["all_gather"] == [float(dp_group[0])] * 3 + [float(dp_group[1])] * 3
        me = tp_group.index(rank)
        summed = [2 * v + sum(tp_group) for v in range(4)]
        assert out["reduce_scatter"] == summed[2 * me : 2 * me + 2]
        dme = dp_group.index(rank)
        assert out["all_to_all"] == [float(2 * dme + 10 * dp_group[0] + j) for j in range(2)] + [
            float(2 * dme + 10 * dp_group[1] + j) for j in range(2)
        ]
        assert out["broadcast"] == [float(tp_group[0])] * 5
        assert out["p2p"] == [float(tp_peer)] * 3
        recs = out["records"]
        assert recs[0] == ("all_reduce", "tp", "torch.float32", 6, 24, 24)  # 2(n-1)/n * 24
        assert recs[1] == ("all_gather", "dp", "torch.float64", 3, 24, 24)  # (n-1) * 24
        assert recs[2] == ("reduce_scatter", "tp", "torch.float32", 4, 16, 8)
        assert recs[3] == ("all_to_all", "dp", "torch.float32", 4, 16, 8)
        assert recs[4] == ("broadcast", "tp", "torch.bfloat16", 5, 10, 10 if me == 0 else 0)
        assert recs[5] == ("send", "world", "torch.float32", 3, 12, 12)
        assert recs[6] == ("recv", "world", "torch.float32", 3, 12, 0)
        assert out["after"] == 7
        totals = out["totals"]
        assert totals["tp"]["calls"] == 3 and totals["dp"]["calls"] == 2
        assert totals["tp"]["bytes"] == 24 + 16 + 10
        assert out["by_op"][("all_reduce", "tp")] == 1


def _hung_collective():
    """Rank 0 all-reduces over a group whose other member never joins."""
    grid = initialize_model_parallel(ParallelConfig(tp=2, timeout=timedelta(seconds=2)))
    if dist.get_rank() == 0:
        try:
            comm.all_reduce(torch.ones(1), group=grid.group("tp"))
        except CollectiveError as exc:
            return str(exc)
        return "completed?!"
    return None


def test_collective_that_cannot_complete_names_its_group(distributed):
    msg = distributed.run(2, _hung_collective)[0]
    distributed.pool(2).close()  # the abandoned gloo op may leave state behind: start afresh
    assert "all_reduce over group 'tp'" in msg and "[0, 1]" in msg


def test_group_name_of_unregistered_group_lists_ranks():
    assert comm.group_name(None) == "world"


def test_bad_p2p_op_rejected():
    with pytest.raises(ValueError, match="'send' or 'recv'"):
        comm.batch_isend_irecv([comm.P2POp("push", torch.ones(1), 0)])
