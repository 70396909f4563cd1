"""Memory of ZB-H1 against 1F1B, measured: bytes of the tensors autograd saves (a
saved_tensors_hooks pack/free count, parameters excluded) plus the weight-gradient store.

At pp4, m 8, tp-layers blocks (fp64), on every rank: ZB-H1's peak of saved activations is
no more than 1F1B's (its forwards in flight are 1F1B's, and B frees the graph as 1F1B's
backward does), and its peak of saved activations plus pending W's is at most 1F1B's plus
the stated store: r + 1 micro-batches of (input, output grad) per linear on rank r.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from test_tp_sp import DT, LAYERS, B, F, H, S, _Chunk, _data, _master, tp_layers

from pentatron.parallel_state import ParallelConfig, initialize_model_parallel
from pentatron.pipeline import PipelineConfig, StageLayout, get_forward_backward_func

PP, M = 4, 8


class _Meter:
    """Live bytes of saved (non-parameter) tensors, and the peaks with and without a store."""

    def __init__(self) -> None:
        self.live = self.peak_saved = self.peak_total = 0
        self.store: tp_layers.WeightGradStore | None = None

    def sample(self) -> None:
        self.peak_saved = max(self.peak_saved, self.live)
        held = self.store.pending_bytes() if self.store is not None else 0
        self.peak_total = max(self.peak_total, self.live + held)


class _Saved:
    def __init__(self, meter: _Meter, t: torch.Tensor) -> None:
        self.meter, self.t, self.nbytes = meter, t, t.numel() * t.element_size()
        meter.live += self.nbytes
        meter.sample()

    def __del__(self) -> None:
        self.meter.live -= self.nbytes


def _pack(meter: _Meter):
    return lambda t: t if isinstance(t, torch.nn.Parameter) else _Saved(meter, t)


def _unpack(packed):
    return packed.t if isinstance(packed, _Saved) else packed


class _MeteredStore(tp_layers.WeightGradStore):
    def __init__(self, meter: _Meter) -> None:
        super().__init__()
        self.meter = meter
        meter.store = self

    def push(self, item) -> None:
        super().push(item)
        self.meter.sample()


def _peaks(schedule: str) -> tuple[int, int]:
    grid = initialize_model_parallel(ParallelConfig(pp=PP))
    rank = grid.rank("pp")
    layers = StageLayout(LAYERS, PP, None).layers(rank, 0)
    chunk = _Chunk(_master(), layers, rank == 0, grid.group("tp"), 0, 1)
    meter = _Meter()
    store = _MeteredStore(meter) if schedule == "zb-h1" else None

    def forward_step(it, model):
        x, target, mask = next(it)
        with torch.autograd.graph.saved_tensors_hooks(_pack(meter), _unpack):
            out = model(x)

        def loss_func(output):
            loss = (((output - target) ** 2).sum(-1) * mask).sum() / mask.sum()
            return loss, loss.detach()

        return out, loss_func

    config = PipelineConfig(hidden_size=H, pipeline_dtype=DT, weight_grad_store=store)
    get_forward_backward_func(PP, None, schedule)(
        forward_step_func=forward_step,
        data_iterator=iter(_data(M)),
        model=chunk,
        num_microbatches=M,
        seq_length=S,
        micro_batch_size=B,
        config=config,
        grid=grid,
    )
    assert meter.live == 0 and (store is None or store.pending_bytes() == 0)
    return meter.peak_saved, meter.peak_total


def _both() -> dict:
    return {"1f1b": _peaks("1f1b"), "zb-h1": _peaks("zb-h1")}


def test_zb_h1_saves_no_more_than_1f1b_plus_the_w_store(distributed):
    results = distributed.run(PP, _both)
    per_linear_pair = 8 * (S * B * H + S * B * F) * 2  # fc1: x, dY [s,b,F]; fc2: x [s,b,F], dY
    store_per_mb = (LAYERS // PP) * per_linear_pair
    for rank, r in enumerate(results):
        f1b_saved, f1b_total = r["1f1b"]
        zb_saved, zb_total = r["zb-h1"]
        assert f1b_total == f1b_saved > 0
        assert zb_saved <= f1b_saved, (rank, zb_saved, f1b_saved)
        assert zb_total <= f1b_saved + (rank + 1) * store_per_mb, (rank, zb_total, f1b_saved)
        # The store is really measured: the last stage keeps W's pending while it runs B's.
        if rank == PP - 1:
            assert zb_total > zb_saved
