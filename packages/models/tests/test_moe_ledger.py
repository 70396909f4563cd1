"""Communication ledger of the MoE dispatchers (4 gloo ranks, ep=4, tp=1, forward only),
asserted from `comm.trace()` against counts computed from each rank's routing map:

- alltoall: the dispatch all-to-all moves exactly T x topk x h elements (every routed copy),
  of which the copies for experts on other ranks go on the wire; the combine all-to-all
  returns the copies this rank's experts received; the counts exchange is E int64s.
- allgather: all-gather of hidden T h, probs T E (fp32) and routing_map T E (bool) over
  etp-ep, and one reduce-scatter of n T h elements (n = etp * ep = 4).
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

WORLD, EP, T_S, T_B = 4, 4, 6, 2


def _trace(dispatcher):
    grid = initialize_model_parallel(ParallelConfig(tp=1, ep=EP))
    try:
        config = moe_config(expert_model_parallel_size=EP, moe_token_dispatcher_type=dispatcher)
        par = ModelParallel.resolve(config, grid, None)
        torch.manual_seed(0)
        layer = MoELayer(
            config,
            MoESubmodules(router=TopKRouter),
            parallel=par,
            init_method=init_method_normal(0.1),
        )
        g = torch.Generator().manual_seed(100 + grid.rank("ep"))
        x = torch.randn(T_S, T_B, config.hidden_size, generator=g)
        _, routing_map = layer.router(x)
        with comm.trace() as ledger, torch.no_grad():
            layer(x)
        return {"ep_rank": grid.rank("ep"), "map": routing_map, "records": ledger.records}
    finally:
        destroy_model_parallel(grid)


def _both():
    return {d: _trace(d) for d in ("alltoall", "allgather")}


@pytest.fixture(scope="module")
def traces(distributed):
    return distributed.run(WORLD, _both)


def test_alltoall_moves_tokens_times_topk_times_h(traces):
    h, e, k = 32, 8, 2
    local = e // EP
    runs = [r["alltoall"] for r in traces]
    for r in runs:
        me = r["ep_rank"]
        counts = r["map"].sum(0)
        a2a = [x for x in r["records"] if x.op == "all_to_all" and x.dtype == torch.float32]
        ints = [x for x in r["records"] if x.op == "all_to_all" and x.dtype == torch.int64]
        assert len(a2a) == 2 and [x.elements for x in ints] == [e]
        dispatch, combine = a2a
        assert dispatch.elements == T_S * T_B * k * h
        remote = int(counts.sum() - counts[me * local : (me + 1) * local].sum())
        assert dispatch.wire_bytes == remote * h * 4
        received = sum(int(q["map"].sum(0)[me * local : (me + 1) * local].sum()) for q in runs)
        assert combine.elements == received * h


def test_allgather_volumes(traces):
    h, e, t, n = 32, 8, T_S * T_B, EP
    for r in traces:
        recs = r["allgather"]["records"]
        gathers = sorted((str(x.dtype), x.elements) for x in recs if x.op == "all_gather")
        want = [("torch.float32", t * h), ("torch.float32", t * e), ("torch.bool", t * e)]
        assert gathers == sorted(want)
        scatters = [x.elements for x in recs if x.op == "reduce_scatter"]
        assert scatters == [n * t * h]
        assert not [x for x in recs if x.op == "all_to_all"]
