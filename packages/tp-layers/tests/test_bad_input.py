"""Bad input fails loudly, naming the field, the rule and a fix; plus the padding helper."""

import pytest
import torch
import torch.distributed as dist

from pentatron.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPConfigError,
    VocabParallelEmbedding,
    pad_vocab_size,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)


def _message(fn):
    try:
        fn()
    except TPConfigError as exc:
        return str(exc)
    return None


def _errors_at_tp2():
    group = dist.group.WORLD
    col_sp = ColumnParallelLinear(4, 8, tp_group=group, sequence_parallel=True)
    return {
        "column out": _message(lambda: ColumnParallelLinear(4, 5, tp_group=group)),
        "row in": _message(lambda: RowParallelLinear(5, 4, tp_group=group)),
        "vocab": _message(lambda: VocabParallelEmbedding(7, 4, tp_group=group)),
        "stride": _message(lambda: ColumnParallelLinear(4, 6, tp_group=group, stride=2)),
        "seq": _message(lambda: scatter_to_sequence_parallel_region(torch.ones(3, 2), group)),
        "col in": _message(lambda: col_sp(torch.ones(4, 1, 3))),
        "row in dim": _message(
            lambda: RowParallelLinear(4, 2, tp_group=group, input_is_parallel=True)(
                torch.ones(2, 4)
            )
        ),
        "ids": _message(
            lambda: VocabParallelEmbedding(8, 2, tp_group=group)(torch.tensor([[0, 8]]))
        ),
        "target": _message(
            lambda: vocab_parallel_cross_entropy(
                torch.zeros(2, 1, 4), torch.tensor([[1], [8]]), group
            )
        ),
        "tied weight": _message(
            lambda: ColumnParallelLinear(4, 8, tp_group=group, skip_weight_param_allocation=True)(
                torch.ones(1, 4), torch.ones(8, 4)
            )
        ),
    }


EXPECTED = {
    "column out": ["output_size=5", "not divisible", "tensor-parallel size 2", "fix"],
    "row in": ["input_size=5", "not divisible", "fix"],
    "vocab": ["num_embeddings", "=7", "pad_vocab_size"],
    "stride": ["tp size * stride = 2 * 2", "multiple of 4"],
    "seq": ["sequence dim", "size 3", "multiple of 2"],
    "col in": ["input last dim is 3", "input_size=4"],
    "row in dim": ["input last dim is 4", "input_size/t=2"],
    "ids": ["token id 8", "[0, 8)"],
    "target": ["token id 8", "[0, 8)"],
    "tied weight": ["[output_size/t, input_size] = [4, 4]"],
}


def test_errors_with_a_real_tp_group(distributed):
    for got in distributed.run(2, _errors_at_tp2):
        for name, parts in EXPECTED.items():
            assert got[name] is not None, f"{name}: no error raised"
            for part in parts:
                assert part in got[name], f"{name}: {part!r} not in {got[name]!r}"


def test_single_process_errors():
    # No torch.distributed here: the layers run as plain single-device layers.
    layer = ColumnParallelLinear(4, 6)
    with pytest.raises(TPConfigError, match="input last dim is 5"):
        layer(torch.ones(2, 5))
    with pytest.raises(TPConfigError, match="gather_output=True with sequence_parallel"):
        ColumnParallelLinear(4, 6, gather_output=True, sequence_parallel=True)
    with pytest.raises(TPConfigError, match="input_is_parallel=True"):
        RowParallelLinear(4, 6, sequence_parallel=True)
    with pytest.raises(TPConfigError, match="token id -1"):
        VocabParallelEmbedding(10, 4)(torch.tensor([3, -1]))
    with pytest.raises(TPConfigError, match="integer ids"):
        VocabParallelEmbedding(10, 4)(torch.tensor([1.0]))
    with pytest.raises(TPConfigError, match=r"label_smoothing=1\.5"):
        vocab_parallel_cross_entropy(
            torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), label_smoothing=1.5
        )
    with pytest.raises(TPConfigError, match="does not match logits"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))


def test_single_process_cross_entropy_matches_torch():
    g = torch.Generator().manual_seed(0)
    logits = (10 * torch.randn(5, 3, 11, generator=g, dtype=torch.float64)).requires_grad_()
    target = torch.randint(0, 11, (5, 3), generator=g)
    for eps in (0.0, 0.2):
        ours = vocab_parallel_cross_entropy(logits, target, label_smoothing=eps)
        ref = torch.nn.functional.cross_entropy(
            logits.view(-1, 11), target.view(-1), reduction="none", label_smoothing=eps
        )
        torch.testing.assert_close(ours, ref.view(5, 3), rtol=1e-12, atol=1e-12)
        w = torch.rand(5, 3, generator=g, dtype=torch.float64)
        (got,) = torch.autograd.grad(ours, logits, w)
        (want,) = torch.autograd.grad(ref.view(5, 3), logits, w)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("vocab", "tp", "divisible_by", "padded"),
    [
        (50257, 1, 128, 50304),  # GPT-2: 393 * 128
        (50257, 2, 128, 50432),  # 197 * 256
        (50257, 8, 128, 51200),  # 50 * 1024
        (256, 2, 128, 256),  # already a multiple
        (7, 4, 1, 8),
    ],
)
def test_pad_vocab_size(vocab, tp, divisible_by, padded):
    assert pad_vocab_size(vocab, tp, divisible_by) == padded


def test_pad_vocab_size_rejects_nonsense():
    with pytest.raises(TPConfigError, match="tp_size=0"):
        pad_vocab_size(100, 0)
