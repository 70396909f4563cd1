"""Shared by the end-to-end tests: a tiny GPT's flags and one training run in a worker."""

from __future__ import annotations

# 4 layers, hidden 32, SwiGLU; 255 + 1 tokens pad to 256 at every tp (so the loss does not
# depend on the layout's vocabulary padding); 8 micro-batches of 2 per step at dp=1.
TINY_GPT = [
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--swiglu",
    "--ffn-hidden-size",
    "64",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "16",
    "--mock-data",
    "--vocab-size",
    "255",
    "--make-vocab-size-divisible-by",
    "32",
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "2",
    "--eval-iters",
    "0",
    "--log-interval",
    "1",
    "--no-progress",
]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
# tp2 x pp2 with 2 virtual stages, sequence parallel, ZeRO-1 with overlapped grad reduce
# and param gather: the layout that exercises the most machinery at world 8
TP2_PP2_VPP2_SP_ZERO1 = [
    *TP2_PP2,
    "--num-layers-per-virtual-pipeline-stage",
    "1",
    "--sequence-parallel",
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
]


def train(argv: list[str]) -> list[float | None]:
    """Run the app on this worker's ranks; the per-iteration losses (None off the last stage)."""
    import torch.distributed as dist

    from pentatron.parallel_state import destroy_model_parallel
    from pentatron.pretrain.arguments import parse_args, validate_args
    from pentatron.pretrain.pretrain_gpt import pretrain

    args = validate_args(parse_args(argv), dist.get_world_size())
    try:
        return pretrain(args).losses
    finally:
        destroy_model_parallel()


def last_stage(per_rank: list) -> list:
    """The results of the ranks that hold losses (the last pipeline stage)."""
    out = [r for r in per_rank if r and r[0] is not None]
    assert out, "no rank of the last pipeline stage reported losses"
    return out
