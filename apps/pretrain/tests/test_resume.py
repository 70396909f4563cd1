"""Acceptance: resume is exact, resharded resume continues the run, and faults lose nothing.

- 4 steps, save, rebuild everything from the checkpoint, train to 6: the losses of steps
  5 and 6, and every rank's grad norms (before clipping: they carry the gradients' scale,
  which the losses hide), equal 6 uninterrupted steps bitwise (CPU, dropout on, so the RNG
  is restored too).
  The first run saves with --async-save every 2 steps (writes overlap training, published
  at a later iteration end), the second synchronously.
- Save at tp2-pp2-dp2, resume at tp1-pp1-dp4 and at tp4-pp2-dp1: the next two steps' losses
  and every rank's grad norms equal the uninterrupted run's (rtol 1e-6, fp32: only the
  order of sums differs; measured 2026-12-07: 8.7e-8 on the losses, 8.9e-8 on the norms).
  The same across data-parallel engines: the distributed optimizer's checkpoint resumed with FSDP2 at
  tp1-pp1-dp4, and an FSDP2 checkpoint (tp2-pp2-dp2) resumed with DDP at tp1-pp1-dp4 and
  with FSDP2 at tp4-pp2-dp1.
- A NaN loss stops the run at that iteration on every rank with a message naming it, and
  the latest checkpoint stays the one before; with --on-nan-loss skip the run goes on, and
  the skipped step leaves the params, the optimizer's state (Adam moments and step count,
  fp32 main params) and the LR scheduler bitwise as they were, on every rank.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _app import TINY_GPT, TP2_PP2, last_stage, train, train_record

BASE = [*TINY_GPT, "--seed", "5"]
ARGS = [*BASE, "--use-distributed-optimizer"]
FSDP2 = [*BASE, "--use-torch-fsdp2"]
TP4_PP2 = ["--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def _exact_resume(root):
    argv = ARGS + DROPOUT + TP2_PP2 + ["--train-iters", "6"]
    full = train_record(argv)
    ckpt = os.path.join(root, "ckpt")
    first = train_record(
        [*argv, "--exit-interval", "4", "--save", ckpt, "--save-interval", "2", "--async-save"]
    )
    second = train_record([*argv, "--load", ckpt, "--save", ckpt])
    return full, first, second


def test_resume_is_bitwise_exact(distributed, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("resume"))
    results = distributed.run(8, _exact_resume, root)
    compared = [r for r in results if r[0]["losses"][0] is not None]
    assert len(compared) == 4, f"{len(compared)} ranks of the last stage (tp2 x dp2), want 4"
    for rank, (full, first, second) in enumerate(results):
        last = full["losses"][0] is not None  # the grad norms: every rank's
        for key in ("losses", "grad_norms") if last else ("grad_norms",):
            assert len(full[key]) == 6 and len(first[key]) == 4 and len(second[key]) == 2
            assert first[key] == full[key][:4], (rank, key)
            assert second[key] == full[key][4:], (rank, key)  # bitwise: same floats
    from pentatron.pretrain.checkpointing import read_latest_iteration

    assert read_latest_iteration(os.path.join(root, "ckpt")) == 6


# A vocabulary of 200 pads to 256 at tp2 (56 rows, all in the second shard) and to 224 at
# tp1: the padding rows' logits enter the softmax, so they train and must be restored.
PADDED_VOCAB = ["--vocab-size", "200"]


def _padded_vocab_resume(root: str, base: list[str]) -> tuple[dict, dict, dict]:
    argv = [*base, *PADDED_VOCAB, "--tensor-model-parallel-size", "2", "--train-iters", "6"]
    ckpt = os.path.join(root, "ckpt")
    full = train_record(argv)
    train_record([*argv, "--exit-interval", "3", "--save", ckpt, "--save-interval", "3"])
    resumed = train_record([*argv, "--load", ckpt])
    # tp1: another padded size, so the padding rows start at zero (no error)
    tp1 = [*base, *PADDED_VOCAB, "--train-iters", "6", "--load", ckpt]
    return full, resumed, train_record(tp1)


@pytest.mark.parametrize("base", [ARGS, FSDP2], ids=["distopt", "fsdp2"])
def test_resume_with_a_padded_vocabulary_is_bitwise_exact(distributed, tmp_path, base):
    for full, resumed, tp1 in distributed.run(4, _padded_vocab_resume, str(tmp_path), base):
        assert resumed["losses"] == full["losses"][3:]
        assert resumed["grad_norms"] == full["grad_norms"][3:]
        assert len(tp1["losses"]) == 3 and all(math.isfinite(x) for x in tp1["losses"])


def _save_at_tp2_pp2_dp2(distributed, tmp_path_factory, base):
    ckpt = os.path.join(str(tmp_path_factory.mktemp("reshard")), "ckpt")
    argv = base + TP2_PP2 + ["--train-iters", "8", "--save", ckpt, "--save-interval", "6"]
    per_rank = distributed.run(8, train_record, argv)
    losses = last_stage([r["losses"] for r in per_rank], count=4)[0]
    return ckpt, {"losses": losses, "grad_norms": per_rank[0]["grad_norms"]}


@pytest.fixture(scope="module")
def saved_at_tp2_pp2_dp2(distributed, tmp_path_factory):
    return _save_at_tp2_pp2_dp2(distributed, tmp_path_factory, ARGS)


@pytest.fixture(scope="module")
def saved_with_fsdp2(distributed, tmp_path_factory):
    return _save_at_tp2_pp2_dp2(distributed, tmp_path_factory, FSDP2)


def _assert_next_steps(distributed, saved, world, argv, pp):
    """Steps 7 and 8 after loading step 6: the weights decide step 7's loss and grad norm,
    and the optimizer state (Adam moments, step count) and the scheduler step 8's. The
    grad norms (every rank's) carry the gradients' scale, which the losses hide."""
    # Without dropout: its masks depend on the layout (one stream per tp rank).
    ckpt, reference = saved
    argv = [*argv, "--train-iters", "8", "--load", ckpt, "--ckpt-step", "6"]
    per_rank = distributed.run(world, train_record, argv)
    for losses in last_stage([r["losses"] for r in per_rank], count=world // pp):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(reference["losses"][6:]), rtol=1e-6, atol=0.0
        )
    want = torch.tensor(reference["grad_norms"][6:], dtype=torch.float64)
    for rank, record in enumerate(per_rank):
        got = torch.tensor(record["grad_norms"], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0, msg=f"rank {rank}")


@pytest.mark.parametrize(
    ("world", "layout", "pp"),
    [(4, ARGS, 1), (8, ARGS + TP4_PP2, 2), (4, FSDP2, 1)],
    ids=["tp1-pp1-dp4", "tp4-pp2-dp1", "tp1-pp1-dp4-fsdp2"],
)
def test_resharded_resume_continues_the_run(distributed, saved_at_tp2_pp2_dp2, world, layout, pp):
    _assert_next_steps(distributed, saved_at_tp2_pp2_dp2, world, layout, pp)


@pytest.mark.parametrize(
    ("world", "layout", "pp"),
    [(4, ARGS, 1), (8, FSDP2 + TP4_PP2, 2)],
    ids=["tp1-pp1-dp4-distopt", "tp4-pp2-dp1-fsdp2"],
)
def test_fsdp2_checkpoint_resumes_at_another_layout(
    distributed, saved_with_fsdp2, world, layout, pp
):
    _assert_next_steps(distributed, saved_with_fsdp2, world, layout, pp)


def _nan_at(iteration_to_poison, root, action):
    """Train with a forward step whose loss turns NaN at one iteration."""
    import torch.distributed as dist

    from pentatron.parallel_state import destroy_model_parallel
    from pentatron.pretrain.arguments import parse_args, validate_args
    from pentatron.pretrain.gpt_step import make_forward_step
    from pentatron.pretrain.pretrain_gpt import pretrain
    from pentatron.pretrain.training.loop import NonFiniteLossError

    ckpt = os.path.join(root, action)
    argv = (
        ARGS
        + TP2_PP2
        + ["--train-iters", "6", "--save", ckpt, "--save-interval", "2", "--on-nan-loss", action]
    )
    args = validate_args(parse_args(argv), dist.get_world_size())
    calls = {"n": 0}
    real = None

    def poisoned(data_iterator, model):
        nonlocal real
        if real is None:
            from pentatron.parallel_state import get_default_grid

            real = make_forward_step(get_default_grid(), args.micro_batch_size, args.seq_length)
        output, loss_func = real(data_iterator, model)
        calls["n"] += 1
        per_step = args.num_microbatches * (args.virtual_pipeline_model_parallel_size or 1)
        if (calls["n"] - 1) // per_step + 1 == iteration_to_poison:
            output = output * float("nan")
        return output, loss_func

    unchanged: dict[int, dict[str, bool]] = {}  # iteration -> what one iteration left as was
    try:
        with _recording_unchanged(unchanged):
            state = pretrain(args, forward_step_func=poisoned)
        return {"losses": state.losses, "error": None, "unchanged": unchanged}
    except NonFiniteLossError as e:
        return {"losses": None, "error": str(e), "unchanged": unchanged}
    finally:
        destroy_model_parallel()


def _recording_unchanged(unchanged):
    """Patch the trainer's iteration to record, per iteration, whether the model params, the
    optimizer's state dict (this rank's: inner Adam state, fp32 main params) and the
    scheduler's state (and the lr it set) came out bitwise equal to what went in."""
    from unittest import mock

    from pentatron.pretrain.training.loop import Trainer

    one_iteration = Trainer._one_iteration

    def snapshot(trainer):
        return {
            "params": [p.detach().clone() for c in trainer.chunks for p in c.parameters()],
            "optimizer": _cloned(trainer.optimizer.state_dict()),
            "scheduler": _cloned(
                [trainer.scheduler.state_dict(), trainer.optimizer.param_groups[0]["lr"]]
            ),
        }

    def recording(self, state):
        before = snapshot(self)
        try:
            one_iteration(self, state)
        finally:
            after = snapshot(self)
            unchanged[state.iteration] = {k: _equal(before[k], after[k]) for k in before}

    return mock.patch.object(Trainer, "_one_iteration", recording)


def _cloned(x):
    if torch.is_tensor(x):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _cloned(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_cloned(v) for v in x]
    return x


def _equal(a, b) -> bool:
    """Bitwise (same dtype, same bytes) for tensors, == for the rest, recursively."""
    if torch.is_tensor(a):
        if not torch.is_tensor(b) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        flat_a, flat_b = a.contiguous().view(-1), b.contiguous().view(-1)
        return torch.equal(flat_a.view(torch.uint8), flat_b.view(torch.uint8))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def test_nan_loss_stops_every_rank_and_keeps_the_checkpoint(distributed, tmp_path_factory):
    from pentatron.pretrain.checkpointing import read_latest_iteration

    root = str(tmp_path_factory.mktemp("nan"))
    results = distributed.run(8, _nan_at, 3, root, "stop")
    for r in results:
        assert r["error"] is not None and r["error"].startswith("iteration 3:")
    assert read_latest_iteration(os.path.join(root, "stop")) == 2


def test_nan_loss_skip_goes_on(distributed, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("nan"))
    results = distributed.run(8, _nan_at, 3, root, "skip")
    for r in last_stage([r["losses"] for r in results], count=4):
        assert len(r) == 6 and math.isnan(r[2])
        assert all(math.isfinite(v) for i, v in enumerate(r) if i != 2)
    nothing_changed = {"params": True, "optimizer": True, "scheduler": True}
    everything_changed = {"params": False, "optimizer": False, "scheduler": False}
    for rank, r in enumerate(results):
        assert sorted(r["unchanged"]) == [1, 2, 3, 4, 5, 6], f"rank {rank}"
        assert r["unchanged"][3] == nothing_changed, f"rank {rank}: the skipped step changed it"
        for it in (2, 4):  # the record does see an applied step
            assert r["unchanged"][it] == everything_changed, f"rank {rank}, iteration {it}"


def _resume_with_another_lr(root: str) -> dict:
    """Save at 2 iterations with --lr 1e-3; resume to 3 with --lr 2e-3: refused naming the
    flags; then each of Megatron's two flags decides which lr the schedule keeps."""
    from pentatron.parallel_state import destroy_model_parallel
    from pentatron.pretrain.arguments import parse_args, validate_args
    from pentatron.pretrain.checkpointing import IncompatibleCheckpointError
    from pentatron.pretrain.pretrain_gpt import pretrain

    ckpt = os.path.join(root, "ckpt")
    constant = ["--lr-decay-style", "constant", "--lr-warmup-iters", "0"]
    train([*BASE, *constant, "--train-iters", "2", "--save", ckpt])
    resume = [*BASE, *constant, "--train-iters", "3", "--load", ckpt]
    resume[resume.index("--lr") + 1] = "2e-3"
    out: dict = {}
    try:
        train(resume)
    except IncompatibleCheckpointError as e:
        out["error"] = str(e)
    finally:
        destroy_model_parallel()
    for flag in ("--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"):
        jsonl = os.path.join(root, f"{flag}.jsonl")
        args = validate_args(parse_args([*resume, flag, "--log-jsonl", jsonl]), 1)
        try:
            state = pretrain(args)
        finally:
            destroy_model_parallel()
        with open(jsonl) as f:
            lr = [json.loads(line)["lr"] for line in f if '"train"' in line][-1]
        out[flag] = (state.iteration, lr)
    return out


def test_scheduler_mismatch_names_the_flags_and_each_flag_decides(distributed, tmp_path):
    (out,) = distributed.run(1, _resume_with_another_lr, str(tmp_path))
    error = out["error"]
    assert "the lr schedule's max_lr (--lr) is 0.002 in this run and 0.001 in the checkpoint" in (
        error
    )
    assert (
        "--use-checkpoint-opt_param-scheduler" in error
        and "--override-opt_param-scheduler" in error
    )
    assert "use_checkpoint_opt_param_scheduler=True" not in error  # no Python argument names
    # iteration 3 ran at this run's lr, or at the checkpoint's
    assert out["--override-opt_param-scheduler"] == (3, pytest.approx(2e-3, rel=1e-12))
    assert out["--use-checkpoint-opt_param-scheduler"] == (3, pytest.approx(1e-3, rel=1e-12))


def _strictness_runs(root: str) -> dict:
    """Megatron's --dist-ckpt-strictness on a model that gained (or lost) the q/k norms."""
    from pentatron.parallel_state import destroy_model_parallel
    from pentatron.pretrain.checkpointing import IncompatibleCheckpointError

    plain, qk = os.path.join(root, "plain"), os.path.join(root, "qk")
    train([*BASE, "--train-iters", "3", "--save", plain])
    train([*BASE, "--qk-layernorm", "--train-iters", "3", "--save", qk])
    out: dict = {}

    def attempt(name: str, argv: list[str]) -> None:
        try:
            out[name] = len(train([*BASE, "--train-iters", "4", "--no-load-optim", *argv]))
        except IncompatibleCheckpointError as e:
            out[name] = str(e)
        finally:
            destroy_model_parallel()

    attempt("missing-default", ["--qk-layernorm", "--load", plain])
    attempt(
        "missing-log_all", ["--qk-layernorm", "--load", plain, "--dist-ckpt-strictness", "log_all"]
    )
    attempt("unexpected-default", ["--load", qk])
    attempt("unexpected-raise", ["--load", qk, "--dist-ckpt-strictness", "raise_unexpected"])
    return out


def test_dist_ckpt_strictness_decides_missing_and_unexpected_tensors(distributed, tmp_path):
    (out,) = distributed.run(1, _strictness_runs, str(tmp_path))
    assert "lacks" in out["missing-default"] and "q_layernorm" in out["missing-default"]
    assert out["missing-log_all"] == 1  # loaded at 3, trained iteration 4
    assert out["unexpected-default"] == 1  # assume_ok_unexpected: the extra norms are ignored
    assert "this model does not have" in out["unexpected-raise"]
    assert "--dist-ckpt-strictness log_unexpected" in out["unexpected-raise"]
