"""Shared by the end-to-end tests: a tiny GPT's flags and one training run in a worker."""

from __future__ import annotations

# 4 layers, hidden 32, SwiGLU; a NullTokenizer of 256 ids (eod 255) pads to 256 at every tp (so the loss does not
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
    "256",
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
    # Megatron's defaults differ from what these tests were written for: pin them
    "--max-position-embeddings",
    "16",
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--adam-beta2",
    "0.95",
    "--lr-decay-style",
    "cosine",
    "--num-workers",
    "0",
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
    return train_record(argv)["losses"]


def train_record(argv: list[str], plant: str | None = None) -> dict[str, list]:
    """Run the app on this worker's ranks, with the bug `plant` names planted (see PLANTS).

    Returns {"losses": per iteration (None off the last stage), "grad_norms": per
    iteration, every rank, before clipping, "mtp_losses": per iteration, each MTP depth's
    loss (None without MTP or off the last stage), "loss_scales": per iteration, the loss
    scale after the step, as logged (None without --fp16)}.
    """
    import contextlib

    import torch.distributed as dist

    from pentatron.parallel_state import destroy_model_parallel
    from pentatron.pretrain.arguments import parse_args, validate_args
    from pentatron.pretrain.pretrain_gpt import pretrain

    args = validate_args(parse_args(argv), dist.get_world_size())
    with _planted(plant) if plant else contextlib.nullcontext():
        try:
            state = pretrain(args)
        finally:
            destroy_model_parallel()
    return {
        "losses": state.losses,
        "grad_norms": state.grad_norms,
        "mtp_losses": state.mtp_losses,
        "loss_scales": state.loss_scales,
    }


# Bugs the parity tests must see, each planted in the real code for one run:
#   grad_x2 / grad_x0.5: every gradient scaled (the loss a schedule back-propagates);
#   no_microbatch_average: the 1/micro-batches factor dropped;
#   dp_sum: DDP's grad reduce sums over dp instead of averaging.
PLANTS = ("grad_x2", "grad_x0.5", "no_microbatch_average", "dp_sum")
# Planted only where the feature runs: each cp rank's MTP loss divided by its own token
# counts (test_e2e_mtp.py); the aux-loss grad (MoE, MTP) not scaled by cp (test_e2e_mla.py).
MTP_PLANTS = ("mtp_local_counts", "aux_loss_without_cp")
# The zero-bubble schedule's ordering: the last micro-batch's W (weight gradients) run after
# the step's grad reduction instead of before it (test_e2e_zero_bubble.py).
ZB_PLANTS = ("zb_w_after_reduce", "zbv_w_after_reduce")
# fp16: the loss scale never applied to the loss, which the optimizer still divides out
# (the app's bug before pretrain 0.8.1: every gradient 1/scale too small; test_e2e_fp16.py).
FP16_PLANTS = ("fp16_loss_not_scaled",)


def _planted(plant: str):
    """A context that plants `plant` (one of PLANTS) by patching the module that owns it."""
    from unittest import mock

    from pentatron.optim.distributed import ddp
    from pentatron.pipeline.schedules import common

    apply_loss = common._apply_loss
    if plant in ("grad_x2", "grad_x0.5"):
        factor = 2.0 if plant == "grad_x2" else 0.5
        return mock.patch.object(common, "_apply_loss", lambda *a: apply_loss(*a) * factor)
    if plant == "no_microbatch_average":
        return mock.patch.object(
            common, "_apply_loss", lambda st, *a: apply_loss(st, *a) * st.num_microbatches
        )
    if plant == "dp_sum":
        buffer = ddp.ParamAndGradBuffer

        def summing(*a, **kw):
            kw["gradient_scaling_factor"] = 1.0
            return buffer(*a, **kw)

        return mock.patch.object(ddp, "ParamAndGradBuffer", summing)
    if plant == "aux_loss_without_cp":
        from pentatron.models import set_aux_loss_scale
        from pentatron.pretrain.training import step

        return mock.patch.object(step, "aux_loss_scale_func", lambda grid: set_aux_loss_scale)
    if plant == "mtp_local_counts":
        from pentatron.models import mtp

        return mock.patch.object(mtp, "_summed_over", lambda t, group: t)
    if plant == "fp16_loss_not_scaled":
        from pentatron.optim import MixedPrecisionOptimizer

        return mock.patch.object(MixedPrecisionOptimizer, "scale_loss", lambda self, loss: loss)
    if plant == "zb_w_after_reduce":
        return _w_after_reduce()
    if plant == "zbv_w_after_reduce":
        return _zbv_w_after_reduce()
    raise ValueError(f"plant {plant!r}: one of {PLANTS + MTP_PLANTS + ZB_PLANTS + FP16_PLANTS}")


def _w_after_reduce():
    import contextlib
    from unittest import mock

    from pentatron.pipeline.schedules import one_f_one_b
    from pentatron.pipeline.schedules import zero_bubble_h1 as zb

    table, finalize = zb.weights_after_backward, one_f_one_b.finalize

    def without_last_w(pp, rank, m):
        return {b: [w for w in ws if w != m - 1] for b, ws in table(pp, rank, m).items()}

    def finalize_then_w(state, chunks, forward_only):
        finalize(state, chunks, forward_only)
        state.config.weight_grad_store.run_all()

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(zb, "weights_after_backward", without_last_w))
    stack.enter_context(mock.patch.object(one_f_one_b, "finalize", finalize_then_w))
    return stack


def _zbv_w_after_reduce():
    """ZBV: every rank's last op (a W) dropped from its table and run after finalize."""
    import contextlib
    from unittest import mock

    from pentatron.pipeline.schedules import zbv

    table, finalize = zbv.zbv_schedules, zbv.finalize

    def without_last_w(pp, m):
        tables = table(pp, m)
        assert all(ops[-1].kind == "W" for ops in tables)
        return [ops[:-1] for ops in tables]

    def finalize_then_w(state, chunks, forward_only):
        finalize(state, chunks, forward_only)
        state.config.weight_grad_store.run_all()

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(zbv, "zbv_schedules", without_last_w))
    stack.enter_context(mock.patch.object(zbv, "finalize", finalize_then_w))
    return stack


def first_steps(record: dict[str, list], steps: int) -> dict[str, list]:
    """`record` (train_record's) cut to its first `steps` iterations: what the same run
    stopped by `--exit-interval steps` must give (same data, same lr schedule), so a
    planted bug is caught without a full-length run."""
    return {key: values[:steps] for key, values in record.items()}


def resumed_losses(distributed, common: list[str], layout: list[str], ckpt: str) -> list:
    """Train `common` at `layout` (world 8) to step 3 and save; resume at tp1-pp1-dp4 with
    the distributed optimizer to step 5: each of the 4 ranks' losses of steps 4 and 5."""
    save = [*common, *layout, "--save", ckpt, "--save-interval", "3", "--exit-interval", "3"]
    distributed.run(8, train, save)
    resume = [*common, "--use-distributed-optimizer", "--load", ckpt, "--exit-interval", "5"]
    return last_stage(distributed.run(4, train, resume), count=4)


def last_stage(per_rank: list, count: int | None = None) -> list:
    """The results of the ranks that hold losses (the last pipeline stage); there must be
    `count` of them (world / pp) when given, else at least one."""
    out = [r for r in per_rank if r and r[0] is not None]
    assert out, "no rank of the last pipeline stage reported losses"
    if count is not None:
        assert len(out) == count, f"{len(out)} ranks reported losses, want {count} (world / pp)"
    return out


def assert_matches_reference(
    per_rank: list[dict], reference: dict, rtol: float, loss_rtol: float | None = None
) -> None:
    """Every rank's grad norms (before clipping: they carry the gradients' scale, which Adam
    and clipping hide from the losses) and the last stage's losses equal the one-process
    reference's, within `rtol` (the losses within `loss_rtol` when given)."""
    import torch

    ref_norms = torch.tensor(reference["grad_norms"], dtype=torch.float64)
    for rank, rec in enumerate(per_rank):
        torch.testing.assert_close(
            torch.tensor(rec["grad_norms"], dtype=torch.float64),
            ref_norms,
            rtol=rtol,
            atol=0.0,
            msg=lambda m, rank=rank: f"rank {rank}: grad norms differ from one process: {m}",
        )
    last = last_stage([rec["losses"] for rec in per_rank])
    for losses in last:
        torch.testing.assert_close(
            torch.tensor(losses, dtype=torch.float64),
            torch.tensor(reference["losses"], dtype=torch.float64),
            rtol=rtol if loss_rtol is None else loss_rtol,
            atol=0.0,
            msg=lambda m: f"losses differ from one process: {m}",
        )
