"""P2PCommunicator on its own: every named combination, batched and unbatched, with the
first/last-stage ends, the ring edge the interleaved schedule uses, overlap handles, variable
sequence lengths (shapes first) and the dtype from the config.

Every message carries a value that names its sender and the call (`_value`), so each
received tensor is compared exactly with what the neighbour sent; the parent asserts.
"""

from __future__ import annotations

import pytest
import torch

from pentatron.parallel_state import ParallelConfig, comm, initialize_model_parallel
from pentatron.pipeline import P2PCommunicator, PipelineConfig

S, B, H = 4, 2, 8


def _value(src: int, tag: int, dtype: torch.dtype, s: int = S) -> torch.Tensor:
    """`[s, b, h]`, distinct per (sender, call) and exact in fp32 and fp64."""
    base = torch.arange(s * B * H, dtype=torch.float64).reshape(s, B, H) * 0.5
    return (base + 100 * src + 10000 * tag).to(dtype)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as `t` in a non-contiguous `[s, b, h]` view."""
    out = t.transpose(0, 1).contiguous().transpose(0, 1)
    assert not out.is_contiguous()
    return out


def _p2p_calls(batch: bool, dtype: torch.dtype) -> dict:
    grid = initialize_model_parallel(ParallelConfig(pp=torch.distributed.get_world_size()))
    config = PipelineConfig(hidden_size=H, pipeline_dtype=dtype, batch_p2p_comm=batch)
    p2p = P2PCommunicator.from_grid(grid, config)
    r, shape = p2p.pp_rank, (S, B, H)

    def val(tag: int, s: int = S) -> torch.Tensor:
        return _value(r, tag, dtype, s)

    got: dict = {}
    # Chains (the 1F1B warm-up / cool-down pattern): receive, then pass on.
    got["recv_forward"] = p2p.recv_forward(shape)
    p2p.send_forward(val(1))
    got["recv_backward"] = p2p.recv_backward(shape)
    p2p.send_backward(val(2))
    # The 1F1B steady pair; it resolves from the last stage back to the first.
    got["send_forward_recv_backward"] = p2p.send_forward_recv_backward(val(3), shape)
    got["send_backward_recv_forward"] = p2p.send_backward_recv_forward(val(4), shape)
    # Ring exchanges (every rank at once; the last -> first edge links interleaved chunks).
    got["send_forward_recv_forward"] = p2p.send_forward_recv_forward(val(5), True, shape)
    got["send_forward_recv_forward/ends"] = p2p.send_forward_recv_forward(
        None if p2p.is_last_stage else val(6), not p2p.is_first_stage, shape
    )
    got["send_backward_recv_backward"] = p2p.send_backward_recv_backward(val(7), True, shape)
    with comm.trace() as ledger:
        got["sfbrfb"] = p2p.send_forward_backward_recv_forward_backward(
            val(8), val(9), True, True, shape
        )
    got["sfbrfb/ledger"] = [(x.op, x.elements) for x in ledger.records]
    # A strided output is sent as its values, not its raw memory.
    got["strided"] = p2p.send_forward_recv_forward(_strided(val(11)), True, shape)
    # Overlap: handles come back unwaited, batched or not (the caller waits).
    recv, handles = p2p.send_forward_recv_forward(val(12), True, shape, overlap_p2p_comm=True)
    got["overlap/keys"] = sorted(handles)
    for h in handles.values():
        h.wait()
    got["overlap/forward"] = recv
    recv, handles = p2p.send_backward_recv_backward(val(13), True, shape, overlap_p2p_comm=True)
    for h in handles.values():
        h.wait()
    got["overlap/backward"] = recv
    # Explicit ends: nothing is sent or received.
    with comm.trace() as ledger:
        ends = [
            p2p.recv_forward(shape, is_first_stage=True),
            p2p.recv_backward(shape, is_last_stage=True),
            p2p.send_forward(val(14), is_last_stage=True),
            p2p.send_backward(val(14), is_first_stage=True),
            p2p.send_forward_recv_backward(val(14), shape, is_last_stage=True),
            p2p.send_backward_recv_forward(val(14), shape, is_first_stage=True),
        ]
    got["ends"] = (ends, len(ledger.records))
    # A fixed-length receive needs its shape; the error comes before any message.
    try:
        p2p.recv_forward(None, is_first_stage=False)
        got["no_shape"] = "no error"
    except ValueError as exc:
        got["no_shape"] = str(exc)

    # Variable sequence lengths: rank r sends S + r positions, receivers learn the shape.
    var = P2PCommunicator.from_grid(
        grid,
        PipelineConfig(
            hidden_size=H, pipeline_dtype=dtype, batch_p2p_comm=batch, variable_seq_lengths=True
        ),
    )
    got["var/recv_forward"] = var.recv_forward(None)
    var.send_forward(val(15, S + r))
    got["var/recv_backward"] = var.recv_backward(None)
    var.send_backward(val(16, S + r))
    with comm.trace() as ledger:
        got["var/sfbrfb"] = var.send_forward_backward_recv_forward_backward(
            val(17, S + r), val(18, S + r), True, True, None
        )
    got["var/ledger"] = sorted((x.op, str(x.dtype), x.elements) for x in ledger.records)
    try:
        var.send_forward(torch.zeros(S, B, dtype=dtype), is_last_stage=False)
        got["var/bad_rank"] = "no error"
    except ValueError as exc:
        got["var/bad_rank"] = str(exc)
    return got


def _expected(p: int, r: int, dtype: torch.dtype) -> dict:
    prev, nxt = (r - 1) % p, (r + 1) % p
    first, last = r == 0, r == p - 1

    def v(src: int, tag: int, s: int = S) -> torch.Tensor:
        return _value(src, tag, dtype, s)

    return {
        "recv_forward": None if first else v(prev, 1),
        "recv_backward": None if last else v(nxt, 2),
        "send_forward_recv_backward": None if last else v(nxt, 4),
        "send_backward_recv_forward": None if first else v(prev, 3),
        "send_forward_recv_forward": v(prev, 5),
        "send_forward_recv_forward/ends": None if first else v(prev, 6),
        "send_backward_recv_backward": v(nxt, 7),
        "sfbrfb": (v(prev, 8), v(nxt, 9)),
        "strided": v(prev, 11),
        "overlap/forward": v(prev, 12),
        "overlap/backward": v(nxt, 13),
        "var/recv_forward": None if first else v(prev, 15, S + prev),
        "var/recv_backward": None if last else v(nxt, 16, S + nxt),
        "var/sfbrfb": (v(prev, 17, S + prev), v(nxt, 18, S + nxt)),
    }


def _same(got, want, dtype: torch.dtype, where: str) -> None:
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, dtype, f"{where}[{i}]")
        return
    if want is None:
        assert got is None, where
        return
    assert got is not None, where
    assert got.dtype == dtype and got.requires_grad, (where, got.dtype)  # autograd inputs
    assert got.shape == want.shape, (where, got.shape, want.shape)
    assert torch.equal(got.detach(), want), where


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("batch", "dtype"), [(True, torch.float32), (False, torch.float64)])
def test_every_p2p_combination_delivers_what_the_neighbour_sent(distributed, world, batch, dtype):
    results = distributed.run(world, _p2p_calls, batch, dtype)
    elements = S * B * H
    for r, got in enumerate(results):
        for key, want in _expected(world, r, dtype).items():
            _same(got[key], want, dtype, f"rank {r} {key} batch={batch}")
        # One exchange both ways: 2 sends and 2 receives of [s, b, h].
        assert sorted(got["sfbrfb/ledger"]) == sorted([("send", elements), ("recv", elements)] * 2)
        assert got["overlap/keys"] == ["recv_prev", "send_next"]
        assert got["ends"] == ([None] * 6, 0)
        assert "tensor_shape is required" in got["no_shape"]
        # Variable lengths: each data message is preceded by its int64 shape [3].
        name = str(dtype)
        shapes = [(op, "torch.int64", 3) for op in ("recv", "recv", "send", "send")]
        data = sorted(
            [
                ("recv", name, (S + (r - 1) % world) * B * H),
                ("recv", name, (S + (r + 1) % world) * B * H),
            ]
            + [("send", name, (S + r) * B * H)] * 2
        )
        assert got["var/ledger"] == sorted(shapes + data), got["var/ledger"]
        assert "[s, b, h]" in got["var/bad_rank"]


def _unpaired_variable_calls() -> dict:
    """Variable lengths, calls that do not pair one to one (as an interleaved schedule's
    ranks leave warm-up at different steps): rank 0 sends forward, then in a second call
    takes its grad; rank 1 in one call sends forward and backward and receives both ways;
    rank 2 sends backward and receives forward. Rank 1's grad shape reaches rank 0 only in
    rank 0's second call, after the data of its first has moved."""
    from datetime import timedelta

    grid = initialize_model_parallel(ParallelConfig(pp=3, timeout=timedelta(seconds=20)))
    config = PipelineConfig(hidden_size=H, variable_seq_lengths=True, batch_p2p_comm=False)
    p2p = P2PCommunicator.from_grid(grid, config)
    r = p2p.pp_rank
    out: dict = {}
    if r == 0:
        p2p.communicate(send_next=_value(0, 1, torch.float32, 5))
        out["grad"] = p2p.communicate(recv_next=True)[1]
    elif r == 1:
        got_prev, got_next, _ = p2p.communicate(
            send_next=_value(1, 2, torch.float32, 6),
            send_prev=_value(1, 3, torch.float32, 7),
            recv_prev=True,
            recv_next=True,
        )
        out["fwd"], out["grad"] = got_prev, got_next
    else:
        out["fwd"] = p2p.communicate(send_prev=_value(2, 4, torch.float32, 8), recv_prev=True)[0]
    return {k: v.detach() for k, v in out.items()}


def test_variable_lengths_do_not_deadlock_when_calls_do_not_pair(distributed):
    """Planted (pentatron-pipeline 0.1.8's shape exchange, which waited for its own shape
    sends before the data moved): ranks 0 and 1 wait on each other until the timeout."""
    r0, r1, r2 = distributed.run(3, _unpaired_variable_calls)
    assert torch.equal(r0["grad"], _value(1, 3, torch.float32, 7))
    assert torch.equal(r1["fwd"], _value(0, 1, torch.float32, 5))
    assert torch.equal(r1["grad"], _value(2, 4, torch.float32, 8))
    assert torch.equal(r2["fwd"], _value(1, 2, torch.float32, 6))
