"""--enable-cuda-graph: the bookkeeping around the captured layers, on CPU.

CUDA graphs cannot run here, so the capture function is `pentatron.models.eager_capture`:
a "graph" that replays by running the captured function again and writing its results
into the tensors the capture returned, which is what a CUDA graph replay does to its
static outputs. Everything else is the product path: the recorded order of forwards and
backwards under the interleaved 1F1B schedule, one runner per (layer, micro-batch
position), the static input copies, the autograd node that replays the backward graph and
hands its grads to DDP (tp-layers fuses weight grads into main_grad inside it), and the
pre-hooks a replay must still run (DDP waiting for the overlapped param all-gather).

If two micro-batches in flight shared a runner, the later forward would overwrite the
earlier one's static output and live activations, and the losses would drift; they must
equal the eager run's exactly (fp32, the same kernels in the same order).
The GPU itself is checked by tools/device_checks/cuda_graphs.py.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _app import TINY_GPT, TP2_PP2_VPP2_SP_ZERO1, last_stage

STEPS = 6
ARGS = [
    *TINY_GPT,
    *TP2_PP2_VPP2_SP_ZERO1,
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--position-embedding-type",
    "rope",
    "--train-iters",
    str(STEPS),
    "--seed",
    "11",
]


def _capturing(captured: list):
    """`eager_capture` (the models package's CPU replay), keeping every graph it makes."""
    from pentatron.models import eager_capture

    def capture(fn, pool):
        graph, out = eager_capture(fn, pool)
        captured.append(graph)
        return graph, out

    return capture


def _train(argv, graphs: bool):
    import torch.distributed as dist

    from pentatron.parallel_state import destroy_model_parallel
    from pentatron.pretrain.arguments import parse_args, validate_args
    from pentatron.pretrain.pretrain_gpt import pretrain

    captured = []
    extra = ["--enable-cuda-graph", "--cuda-graph-warmup-steps", "2"] if graphs else []
    # cuda=True: validate as on a GPU machine (on CPU the flag is refused)
    args = validate_args(parse_args(argv + extra), dist.get_world_size(), cuda=True)
    try:
        losses = pretrain(args, cuda_graph_capture=_capturing(captured) if graphs else None).losses
    finally:
        destroy_model_parallel()
    return {"losses": losses, "replays": [g.replays for g in captured]}


@pytest.fixture(scope="module")
def eager(distributed):
    return distributed.run(8, _train, ARGS, False)


def test_graphed_layers_give_the_eager_losses(distributed, eager):
    graphed = distributed.run(8, _train, ARGS, True)
    for e, g in zip(
        last_stage([r["losses"] for r in eager]), last_stage([r["losses"] for r in graphed])
    ):
        assert e == g  # bitwise: the same kernels on the same values
    m, layers_per_rank = 16 // (2 * 2), 2  # micro-batches; 4 layers over pp2 x vpp2
    for rank in graphed:
        # a forward and a backward graph per (layer, micro-batch), each replayed in every
        # step after the 2 recorded ones
        assert len(rank["replays"]) == 2 * m * layers_per_rank
        assert all(n == STEPS - 2 for n in rank["replays"])


def test_bad_cuda_graph_combinations_are_refused():
    from pentatron.pretrain.arguments import ArgumentError, parse_args, validate_args

    base = [*TINY_GPT, "--train-iters", "8", "--enable-cuda-graph"]
    base += ["--hidden-dropout", "0", "--attention-dropout", "0"]
    cases = [
        ([], 1, False, "--enable-cuda-graph="),  # CPU
        (["--hidden-dropout", "0.1"], 1, True, "--hidden-dropout="),
        (["--recompute-granularity", "selective"], 1, True, "--recompute-granularity="),
        (["--num-experts", "4"], 1, True, "--num-experts="),
        (["--use-torch-fsdp2"], 2, True, "--use-torch-fsdp2="),
        (["--rampup-batch-size", "4", "4", "64"], 1, True, "--rampup-batch-size="),
        (["--cuda-graph-warmup-steps", "0"], 1, True, "--cuda-graph-warmup-steps="),
    ]
    for extra, world, cuda, flag in cases:
        with pytest.raises(ArgumentError) as info:
            validate_args(parse_args(base + extra), world, cuda=cuda)
        assert str(info.value).startswith(flag) and "fix:" in str(info.value), info.value
