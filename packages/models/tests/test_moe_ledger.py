"""Communication ledger of the MoE dispatchers (4 gloo ranks, tp=1, ep x etp = 4 x 1 and
2 x 2), forward and backward, asserted from `comm.trace()` and from the split sizes handed
to `all_to_all_single`, against counts computed here from every rank's routing map.

alltoall (local = E/ep experts per rank; `mine[j]`: this rank's token-assignments routed
to ep peer j's experts; `theirs[j]`: peer j's assignments routed to this rank's experts,
peer j being the rank with ep rank j and this rank's etp rank):
- forward: counts exchange E int64s over ep (and E more gathered over etp); dispatch
  all-to-all sends `mine[j] * h * 4` bytes to peer j (T x topk x h elements in all);
  combine all-to-all sends `theirs[j] * h * 4` bytes back to peer j.
- backward: the same two all-to-alls in reverse order (combine's first), same splits.
- etp > 1: the received tokens are all-gathered over etp and the expert outputs
  reduce-scattered back. Ranks hold different row counts and gloo has no uneven
  all-gather, so both pad every rank's part to the largest (`_gather_uneven`): each
  moves max_q(received_q) rows per rank, more than the routing alone implies.
allgather (n = etp x ep = 4):
- forward: all-gather of hidden T h, probs T E (fp32) and routing_map T E (bool) over
  etp-ep, one reduce-scatter of n T h;
- backward: reduce-scatter of the hidden grad (n T h) and the probs grad (n T E), and
  all-gather of the output grad (T h).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _moe import TopKRouter, moe_config

from pentatron.models import ModelParallel
from pentatron.models.moe.moe_layer import MoELayer, MoESubmodules
from pentatron.parallel_state import (
    ParallelConfig,
    comm,
    destroy_model_parallel,
    initialize_model_parallel,
)
from pentatron.tp_layers import init_method_normal

WORLD, T_S, T_B, H, E, K = 4, 6, 2, 32, 8, 2
T = T_S * T_B
LAYOUTS = [(4, 1), (2, 2)]  # (ep, etp)


def _spy(real, splits: list):
    """`real` (comm.all_to_all_single) that also records the float payload's input splits."""

    def spy(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        if input.is_floating_point():
            splits.append(list(input_split_sizes))
        return real(output, input, output_split_sizes, input_split_sizes, **kw)

    return spy


def _trace(dispatcher: str, ep: int, etp: int) -> dict:
    grid = initialize_model_parallel(ParallelConfig(tp=1, ep=ep, etp=etp))
    real = comm.all_to_all_single
    try:
        config = moe_config(
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            moe_token_dispatcher_type=dispatcher,
        )
        par = ModelParallel.resolve(config, grid, None)
        torch.manual_seed(0)
        layer = MoELayer(
            config,
            MoESubmodules(router=TopKRouter),
            parallel=par,
            init_method=init_method_normal(0.1),
        )
        g = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
        x = torch.randn(T_S, T_B, H, generator=g, requires_grad=True)
        with torch.no_grad():
            _, routing_map = layer.router(x)
        splits: dict[str, list] = {"forward": [], "backward": []}
        out = {"ep": grid.rank("ep"), "etp": grid.rank("etp"), "map": routing_map}
        for phase in ("forward", "backward"):
            comm.all_to_all_single = _spy(real, splits[phase])
            with comm.trace() as ledger:
                if phase == "forward":
                    y, _ = layer(x)
                else:
                    y.backward(torch.randn(y.shape, generator=g))
            comm.all_to_all_single = real
            out[phase] = ledger.records
        out["splits"] = splits
        return out
    finally:
        comm.all_to_all_single = real
        destroy_model_parallel(grid)


def _all_runs():
    return {
        (d, ep, etp): _trace(d, ep, etp) for ep, etp in LAYOUTS for d in ("alltoall", "allgather")
    }


@pytest.fixture(scope="module")
def traces(distributed):
    return distributed.run(WORLD, _all_runs)


def _runs(traces, key):
    return [r[key] for r in traces]


def _routed(r, ep_rank, local):
    """Assignments of rank r's tokens to the experts of ep rank `ep_rank`."""
    return int(r["map"][:, ep_rank * local : (ep_rank + 1) * local].sum())


def _floats(records, op, group):
    return [x for x in records if x.op == op and x.group == group and x.dtype == torch.float32]


@pytest.mark.parametrize("ep, etp", LAYOUTS)
def test_alltoall_sends_each_peer_its_experts_tokens(traces, ep, etp):
    runs, local = _runs(traces, ("alltoall", ep, etp)), E // ep
    peer = {(r["ep"], r["etp"]): r for r in runs}
    for r in runs:
        me = r["ep"]
        mine = [_routed(r, j, local) for j in range(ep)]
        theirs = [_routed(peer[(j, r["etp"])], me, local) for j in range(ep)]
        assert sum(mine) == T * K
        # forward: dispatch then combine; backward: combine's adjoint then dispatch's
        assert r["splits"]["forward"] == [mine, theirs]
        assert r["splits"]["backward"] == [mine, theirs]
        for phase in ("forward", "backward"):
            a2a = _floats(r[phase], "all_to_all", "ep")
            assert [x.elements for x in a2a] == [T * K * H, sum(theirs) * H]
            sent = [sum(s) - s[me] for s in (mine, theirs)]
            assert [x.wire_bytes for x in a2a] == [n * H * 4 for n in sent]
        ints = [x for x in r["forward"] if x.dtype == torch.int64]
        want = [("all_to_all", "ep", E)] + ([("all_gather", "etp", E)] if etp > 1 else [])
        assert [(x.op, x.group, x.elements) for x in ints] == want
        assert not [x for x in r["backward"] if x.dtype == torch.int64]


def test_alltoall_etp_gathers_padded_to_the_largest_part(traces):
    ep, etp = 2, 2
    runs, local = _runs(traces, ("alltoall", ep, etp)), E // ep
    peer = {(r["ep"], r["etp"]): r for r in runs}

    def received(e, q):  # rows ep rank e, etp rank q gets from the all-to-all
        return sum(_routed(peer[(j, q)], e, local) for j in range(ep))

    for r in runs:
        sizes = [received(r["ep"], q) for q in range(etp)]
        rows = max(sizes)  # the padded part every rank hands the collective
        for phase, ops in (
            ("forward", ("all_gather", "reduce_scatter")),
            ("backward", ("reduce_scatter", "all_gather")),
        ):
            recs = [x for x in r[phase] if x.group == "etp" and x.dtype == torch.float32]
            assert sorted(x.op for x in recs) == sorted(ops)
            for x in recs:
                want = rows * H if x.op == "all_gather" else etp * rows * H
                assert x.elements == want
    # the padding is real in this data: some etp pair differs in its row counts
    assert any(received(e, 0) != received(e, 1) for e in range(ep))


@pytest.mark.parametrize("ep, etp", LAYOUTS)
def test_allgather_volumes(traces, ep, etp):
    n = ep * etp
    for r in _runs(traces, ("allgather", ep, etp)):
        fwd, bwd = r["forward"], r["backward"]
        gathers = sorted((str(x.dtype), x.elements) for x in fwd if x.op == "all_gather")
        want = [("torch.float32", T * H), ("torch.float32", T * E), ("torch.bool", T * E)]
        assert gathers == sorted(want)
        assert [x.elements for x in fwd if x.op == "reduce_scatter"] == [n * T * H]
        assert sorted(x.elements for x in bwd if x.op == "reduce_scatter") == sorted(
            [n * T * H, n * T * E]
        )
        assert [x.elements for x in bwd if x.op == "all_gather"] == [T * H]
        assert {x.group for x in fwd + bwd} == {"etp-ep"}
        assert not [x for x in fwd + bwd if x.op == "all_to_all"]
