"""Model-parallel RNG (masks across tp and dp ranks) and recomputation (exact replay)."""

import torch
import torch.nn.functional as F

from pentatron.parallel_state import ParallelConfig, initialize_model_parallel
from pentatron.tp_layers import (
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    checkpoint,
    get_rng_tracker,
    model_parallel_seed,
)


def _masks():
    grid = initialize_model_parallel(ParallelConfig(tp=2))  # 4 ranks: tp 2 x dp 2
    model_parallel_seed(1234, grid)
    ones = torch.ones(256)
    with get_rng_tracker().fork():
        inside = F.dropout(ones, 0.5) > 0
    outside = F.dropout(ones, 0.5) > 0
    return grid.rank("tp"), grid.rank("dp"), inside.tolist(), outside.tolist()


def test_dropout_masks_differ_across_tp_and_match_across_dp(distributed):
    results = distributed.run(4, _masks)
    by_pos = {(tp, dp): (inside, outside) for tp, dp, inside, outside in results}
    assert len(by_pos) == 4
    for dp in (0, 1):
        assert by_pos[(0, dp)][0] != by_pos[(1, dp)][0]  # inside TP region: per tp rank
    for tp in (0, 1):
        assert by_pos[(tp, 0)][0] == by_pos[(tp, 1)][0]  # same stream across dp
    outside = [o for _, o in by_pos.values()]
    assert all(o == outside[0] for o in outside)  # replicated region: same everywhere
    assert outside[0] != by_pos[(0, 0)][0]


def test_fork_leaves_default_generator_alone():
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 7)
    torch.manual_seed(0)
    plain = torch.rand(4), torch.rand(4)
    torch.manual_seed(0)
    first = torch.rand(4)
    with tracker.fork("a"):
        forked = torch.rand(4)
    assert torch.equal(first, plain[0]) and torch.equal(torch.rand(4), plain[1])
    assert torch.equal(forked, torch.rand(4, generator=torch.Generator().manual_seed(7)))
    with tracker.fork("a"):  # the named state advanced: a new draw, not a repeat
        assert not torch.equal(torch.rand(4), forked)


def test_tracker_rejects_duplicates_and_unknown_names():
    tracker = RNGStatesTracker("cpu")
    tracker.add("a", 1)
    for call, match in [
        (lambda: tracker.add("b", 1), "seed 1 already"),
        (lambda: tracker.add("a", 2), "already exists"),
    ]:
        try:
            call()
        except ValueError as exc:
            assert match in str(exc)
        else:
            raise AssertionError("duplicate accepted")
    try:
        with tracker.fork("missing"):
            pass
    except KeyError as exc:
        assert "model_parallel_seed" in str(exc)
    else:
        raise AssertionError("unknown name accepted")


def test_model_parallel_seed_offsets_by_tp_rank_without_a_grid():
    """Users with their own groups pass ranks; the stream is Megatron's seed + 2718 + tp."""
    tracker = RNGStatesTracker("cpu")
    draws = []
    for tp_rank in (0, 1):
        model_parallel_seed(42, tp_rank=tp_rank, tracker=tracker)
        with tracker.fork(MODEL_PARALLEL_RNG):
            draws.append(torch.rand(3))
    g = torch.Generator()
    assert torch.equal(draws[0], torch.rand(3, generator=g.manual_seed(42 + 2718)))
    assert torch.equal(draws[1], torch.rand(3, generator=g.manual_seed(42 + 2719)))


class _Block(torch.nn.Module):
    """Linear -> dropout in the tracker's region -> GeLU -> Linear -> plain dropout."""

    def __init__(self, tracker):
        super().__init__()
        self.fc1, self.fc2, self.tracker = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16), tracker

    def forward(self, x):
        h = self.fc1(x)
        with self.tracker.fork():
            h = F.dropout(h, 0.3, training=True)
        return F.dropout(self.fc2(F.gelu(h)), 0.2, training=True)


def _train_step(recompute, seed=0):
    tracker = RNGStatesTracker("cpu")
    tracker.add(MODEL_PARALLEL_RNG, 99)
    torch.manual_seed(seed)
    block = _Block(tracker)
    x = torch.randn(32, 16, requires_grad=True)
    y = checkpoint(block, x, tracker=tracker) if recompute else block(x)
    after = torch.rand(3)  # the RNG stream after the block must not depend on recompute
    y.pow(2).sum().backward()
    return y.detach(), x.grad, [p.grad for p in block.parameters() if p.grad is not None], after


def test_recompute_with_dropout_gives_identical_output_and_grads():
    y0, gx0, gp0, after0 = _train_step(recompute=False)
    y1, gx1, gp1, after1 = _train_step(recompute=True)
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1) and torch.equal(after0, after1)
    assert len(gp0) == len(gp1) == 4 and all(torch.equal(a, b) for a, b in zip(gp0, gp1))


def _saved_bytes(recompute):
    tracker = RNGStatesTracker("cpu")
    tracker.add(MODEL_PARALLEL_RNG, 5)
    torch.manual_seed(0)
    block = _Block(tracker)
    x = torch.randn(128, 16, requires_grad=True)
    params = {p.data_ptr() for p in block.parameters()}
    saved = []

    def pack(t):  # parameters are stored anyway; count activations only
        if t.data_ptr() not in params:
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = checkpoint(block, x, tracker=tracker) if recompute else block(x)
    y.sum().backward()
    return sum(saved)


def test_recompute_saves_less_activation_memory():
    plain, recomputed = _saved_bytes(False), _saved_bytes(True)
    assert recomputed == 128 * 16 * 4  # only the block's input
    assert plain > 4 * recomputed  # fc1 in/out, dropout masks, gelu input, fc2 in/out ...


def test_checkpoint_passes_non_tensor_args_and_tuples():
    w = torch.randn(3, requires_grad=True)

    def fn(x, scale, name):
        assert name == "n"
        return x * w * scale, x.sum()

    x = torch.randn(3, requires_grad=True)
    a, b = checkpoint(fn, x, 2.0, "n", tracker=RNGStatesTracker("cpu"))
    (a.sum() + b).backward()
    assert torch.allclose(x.grad, 2.0 * w.detach() + 1.0)
    assert torch.allclose(w.grad, 2.0 * x.detach())
