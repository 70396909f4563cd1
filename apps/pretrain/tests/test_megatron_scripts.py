"""Megatron-LM's own example launch scripts (their flags copied as data in
_megatron_scripts.py): every flag parses, and each script, scaled to a CPU world of 2 with
test paths, validates; what it asks for that this machine or release cannot do is refused
with one line naming the flag, and only that; with those dropped and its data and tokenizer
files made here, it trains 2 steps. Also the Megatron flags that map onto ours."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from _megatron_scripts import SCRIPTS
from _tokenizer_files import LINES, gpt2_files, hf_word_level, train_sp

from pentatron.pretrain.arguments import ArgumentError, parse_args, validate_args

# The layout and size of each script scaled to a world of 2 on CPU (the flags Megatron's
# scripts pass for a cluster); paths point at nothing the validation opens.
SCALE = {
    "--num-layers": ["4"],
    "--hidden-size": ["64"],
    "--ffn-hidden-size": ["128"],
    "--moe-ffn-hidden-size": ["32"],
    "--num-attention-heads": ["4"],
    "--num-query-groups": ["2"],
    "--kv-channels": ["16"],
    "--seq-length": ["32"],
    "--max-position-embeddings": ["64"],
    "--micro-batch-size": ["1"],
    "--global-batch-size": ["4"],
    "--tensor-model-parallel-size": ["1"],
    "--pipeline-model-parallel-size": ["2"],
    "--expert-model-parallel-size": ["1"],
    "--num-experts": ["4"],
    "--moe-layer-freq": ["1"],
    "--moe-router-topk": ["2"],
    "--moe-shared-expert-intermediate-size": ["32"],
    "--moe-router-num-groups": ["2"],
    "--moe-router-group-topk": ["1"],
    "--q-lora-rank": ["32"],
    "--kv-lora-rank": ["16"],
    "--train-iters": ["2"],
    "--eval-iters": ["1"],
    "--log-interval": ["1"],
    "--train-samples": ["8"],
    "--lr-decay-samples": ["8"],
    "--lr-warmup-samples": ["4"],
    "--vocab-size": ["256"],
    "--decoder-first-pipeline-num-layers": ["2"],
    "--decoder-last-pipeline-num-layers": ["2"],
    "--save": ["ckpt-not-opened-by-validation"],
    "--load": ["ckpt-not-opened-by-validation"],
}
# The flags a run needs that Megatron gives no default (a tiny model), with mock data.
MINIMAL = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
MINIMAL += ["--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1"]
MINIMAL += ["--lr", "1e-3"]
DROP = {"--data-path", "--data-cache-path", "--tensorboard-dir"}
DROP |= {"--vocab-file", "--merge-file", "--tokenizer-model", "--wandb-save-dir"}
DROP |= {"--profile", "--lr-warmup-iters", "--lr-decay-iters"}  # samples-based below

# What each script asks for that is refused on a CPU machine with this release, one line
# each (the flag named first): FP8 / cuDNN attention need CUDA, DeepSeek-V3's flex
# dispatcher needs its kernels, Megatron-FSDP's NCCL buffers. (gpt-oss runs whole.)
_FP8 = {"--fp8-format", "--fp8-param-gather"}
_MFSDP_BUFFERS = {"--use-nccl-ub", "--fsdp-double-buffer", "--init-model-with-meta-device"}
REFUSED_ON_CPU = {
    "examples/gpt3/train_gpt3_175b_distributed.sh": set(),  # fp16 runs on CPU too
    "examples/llama/train_llama3_8b_h100_fp8.sh": _FP8 | {"--attention-backend"},
    # wandb: not installed here (the [wandb] extra), refused with the install line
    "examples/mixtral/train_mixtral_8x7b_distributed.sh": {"--wandb-project"},
    "examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh": _MFSDP_BUFFERS
    | {
        "--moe-token-dispatcher-type",  # flex: DeepEP / HybridEP kernels
        "--megatron-fsdp-main-grads-dtype",  # bf16 main grads
        "--wandb-project",
        "--ckpt-format",  # fsdp_dtensor
    },
    "examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh": _MFSDP_BUFFERS
    | _FP8
    | {
        "--fsdp-manual-registration",
        "--record-memory-history",
        "--attention-backend",
        "--ckpt-format",
    },
    "examples/gptoss/02_train.sh": _FP8,
}


def _argv(flags: list[tuple[str, list[str]]]) -> list[str]:
    out: list[str] = []
    for flag, values in flags:
        out += [flag, *values]
    return out


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_every_flag_of_the_script_parses(script):
    args = parse_args(_argv(SCRIPTS[script]))
    assert args is not None


def _scaled(script: str) -> list[tuple[str, list[str]]]:
    by_samples = any(f == "--train-samples" for f, _ in SCRIPTS[script])
    out = []
    for flag, values in SCRIPTS[script]:
        if flag in DROP or (flag == "--train-iters" and by_samples):
            continue
        out.append((flag, SCALE.get(flag, values) if values else values))
    if not any(f in ("--tokenizer-type", "--mock-data") for f, _ in out):
        out.append(("--mock-data", []))
    if not any(f == "--mock-data" for f, _ in out):  # data files are the data tests' concern
        out = [(f, v) for f, v in out if f not in ("--tokenizer-type",)] + [("--mock-data", [])]
    return out


def _validate_dropping_refusals(flags) -> tuple[set[str], list[str], object, list[str]]:
    """Validate, dropping each refused flag; (refused flags, their lines, args, the argv
    left)."""
    refused, lines = set(), []
    for _ in range(40):
        try:
            args = validate_args(parse_args(_argv(flags)), 2, cuda=False)
            return refused, lines, args, _argv(flags)
        except ArgumentError as e:
            line = str(e)
            assert "\n" not in line and "fix:" in line, line
            flag = line.split("=", 1)[0].split(":", 1)[0]
            assert flag in {f for f, _ in flags}, f"the refusal names no flag of the script: {line}"
            refused.add(flag)
            lines.append(line)
            flags = [(f, v) for f, v in flags if f != flag]
    raise AssertionError("no end to refusals")


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_script_validates_on_cpu_refusing_only_what_cannot_run(script):
    refused, lines, args, _ = _validate_dropping_refusals(_scaled(script))
    assert refused == REFUSED_ON_CPU[script], lines
    assert args.train_iters >= 1


# ----------------------------------------------------------------------------------------
# Each script trains 2 steps on CPU: its tokenizer on a model file made here, its data a
# .bin/.idx corpus of that tokenizer's ids, its checkpoints in a temporary folder.


def _corpus(prefix, tokenizer) -> str:
    import numpy as np

    from pentatron.pretrain.data.indexed_dataset import build_from_documents

    # 15,000 short documents: Mixtral's --split 99990,8,2 leaves the validation split one
    docs = [[*tokenizer.tokenize(line), tokenizer.eod] for line in LINES] * 50
    build_from_documents(prefix, docs, dtype=np.int32)
    return str(prefix)


@pytest.fixture(scope="module")
def script_files(tmp_path_factory):
    """Per tokenizer kind: the flags that point at its files, with a corpus made with it."""
    pytest.importorskip("sentencepiece")
    pytest.importorskip("tokenizers")
    from pentatron.pretrain.tokenizer import build_tokenizer

    d = tmp_path_factory.mktemp("script-files")
    vocab, merges, _ = gpt2_files(d, with_eod=True)
    sp_model = train_sp(d / "sp")
    hf_dir = str(hf_word_level(d / "hf"))
    kinds = {
        "GPT2BPETokenizer": (
            {"--vocab-file": vocab, "--merge-file": merges},
            build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges),
        ),
        "Llama2Tokenizer": (
            {"--tokenizer-model": sp_model},
            build_tokenizer("Llama2Tokenizer", sp_model),
        ),
        "HuggingFaceTokenizer": (
            {"--tokenizer-model": hf_dir},
            build_tokenizer("HuggingFaceTokenizer", hf_dir),
        ),
    }
    out = {}
    for kind, (paths, tokenizer) in kinds.items():
        paths["--data-path"] = _corpus(d / kind / "corpus", tokenizer)
        out[kind] = (paths, tokenizer.vocab_size)
    return out


def _with_test_files(script: str, files, ckpt) -> tuple[list[tuple[str, list[str]]], int]:
    """The script's flags scaled (as above), its paths replaced by the test's; the
    tokenizer's vocabulary size (NullTokenizer: the scaled --vocab-size)."""
    flags = dict(SCRIPTS[script])
    kind = (flags.get("--tokenizer-type") or ["GPT2BPETokenizer"])[0]
    mock = "--mock-data" in flags
    paths, vocab = ({}, int(SCALE["--vocab-size"][0])) if mock else files[kind]
    out = []
    for flag, values in SCRIPTS[script]:
        if flag == "--train-iters" and "--train-samples" in flags:
            continue
        if flag in paths:
            values = [paths[flag]]
        elif flag in ("--save", "--load"):
            values = [str(ckpt)]
        elif flag in DROP or flag == "--tokenizer-model":
            continue  # NullTokenizer's placeholder model; mock data's placeholder path
        else:
            values = SCALE.get(flag, values) if values else values
        out.append((flag, values))
    return out, vocab


def _loss_at_init(vocab: int, divisible_by: int) -> float:
    """ln of the padded vocabulary: the loss of near-zero logits (init std 0.02)."""
    import math

    return math.log(-(-vocab // divisible_by) * divisible_by)


def _torchrun(argv: list[str], cwd) -> tuple[int, str]:
    """`torchrun --nproc-per-node 2 -m pentatron.pretrain ARGV` as a user launches it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += ["2", "-m", "pentatron.pretrain", *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=300, check=False
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_script_trains_two_steps_on_cpu(script, script_files, tmp_path):
    """torchrun with the script's flags (scaled, test files, refusals dropped): 2 steps whose
    first loss is that of near-zero logits over the tokenizer's padded vocabulary (so the
    data's ids and the tokenizer agree), a checkpoint at iteration 2, a clean exit."""
    flags, vocab = _with_test_files(script, script_files, tmp_path / "ckpt")
    refused, lines, args, argv = _validate_dropping_refusals(flags)
    assert refused == REFUSED_ON_CPU[script], lines
    assert args.train_iters == 2
    if "--mock-data" not in dict(flags):
        assert args.data_path == [dict(flags)["--data-path"][0]]
    metrics = tmp_path / "metrics.jsonl"
    rc, out = _torchrun([*argv, "--log-jsonl", str(metrics)], tmp_path)
    assert rc == 0, out[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if r.get("split") == "train"]
    assert len(train) == 2, records
    losses = [r["lm_loss"] for r in train]
    if args.fp16:
        # Megatron's initial loss scale, 2^32, overflows a fresh model's fp16 grads: both
        # steps are skipped (no loss logged), the scale is halved once the hysteresis of 2
        # is used up (logged after the step, as Megatron does), the weights stay at init,
        # and the validation loss is theirs.
        assert [r["skipped_iterations"] for r in train] == [1, 1], train
        assert [r["loss_scale"] for r in train] == [2.0**32, 2.0**31], train
        assert losses == [None, None], train
        losses = [r["lm_loss"] for r in records if r.get("split") == "valid"]
    init = _loss_at_init(vocab, args.make_vocab_size_divisible_by)
    assert abs(losses[0] - init) < 0.05, (losses, init)  # measured: at most 0.015
    assert all(loss == loss and loss < init + 1.0 for loss in losses)
    # the logged lr is --lr's schedule (not --decoupled-lr's, the Llama script's 5e-4)
    assert all(0 < r["lr"] <= args.lr for r in records if r.get("split") == "train")
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_pre_softmax_with_sigmoid_is_megatrons_no_op():
    moe = [*MINIMAL, "--train-iters", "2", "--num-experts", "4", "--moe-router-pre-softmax"]
    args = validate_args(parse_args([*moe, "--moe-router-score-function", "sigmoid"]), 1)
    assert args.moe_router_pre_softmax is False
    assert any(n.startswith("--moe-router-pre-softmax: no effect") for n in args.startup_notes)
    softmax = validate_args(parse_args(moe), 1)  # the softmax router reads it
    assert softmax.moe_router_pre_softmax is True
    assert not any("--moe-router-pre-softmax" in n for n in softmax.startup_notes)


def test_kernel_choices_are_named_at_start_up():
    args = validate_args(
        parse_args([*MINIMAL, "--train-iters", "2", "--use-mcore-models", "--no-rope-fusion"]),
        1,
    )
    notes = "\n".join(args.startup_notes)
    assert "--use-mcore-models" in notes and "--no-rope-fusion" in notes
    quiet = validate_args(parse_args([*MINIMAL, "--train-iters", "2"]), 1)
    assert not any("--use-mcore-models" in n for n in quiet.startup_notes)


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--multi-latent-attention"], "--position-embedding-type"),  # MLA needs RoPE
        (["--kv-lora-rank", "512"], "--kv-lora-rank"),  # an MLA shape without MLA
        (["--rotary-scaling-factor", "40"], "--rotary-scaling-factor"),  # YaRN
        (["--mtp-num-layers", "0"], "--mtp-num-layers"),  # a bad value, by name
        (["--window-size", "127,1"], "--window-size"),  # GPT attention is causal
        (["--window-attn-skip-freq", "2"], "--window-attn-skip-freq"),  # needs a window
        (["--glu-linear-offset", "1.0"], "--swiglu"),  # offsets a gated activation only
        (["--quick-geglu", "--swiglu"], "--quick-geglu"),
        (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type"),
        (["--cp-comm-type", "p2p", "a2a"], "--cp-comm-type"),
        (
            ["--no-position-embedding", "--position-embedding-type", "learned_absolute"],
            "--no-position-embedding",
        ),
        (["--use-nccl-ub"], "--use-nccl-ub"),
    ],
)
def test_features_we_lack_are_refused_in_one_line(flags, field):
    with pytest.raises(ArgumentError) as e:
        validate_args(parse_args([*MINIMAL, "--train-iters", "2", *flags]), 1)
    assert str(e.value).startswith(field) and "fix:" in str(e.value)


@pytest.mark.parametrize(
    "strategy, fsdp2, reshard, distopt",
    [
        ("optim_grads_params", True, True, False),
        ("optim_grads", True, False, False),
        ("optim", False, True, True),
        ("no_shard", False, True, False),
    ],
)
def test_megatron_fsdp_maps_onto_our_data_parallel_paths(strategy, fsdp2, reshard, distopt):
    args = validate_args(
        parse_args(
            [
                *MINIMAL,
                "--train-iters",
                "2",
                "--use-megatron-fsdp",
                "--data-parallel-sharding-strategy",
                strategy,
            ]
        ),
        2,
    )
    assert (args.use_torch_fsdp2, args.fsdp_reshard_after_forward) == (fsdp2, reshard)
    assert args.use_distributed_optimizer is distopt
    assert any("--use-megatron-fsdp" in n for n in args.startup_notes)


def test_recompute_activations_and_cp_comm_type_spellings():
    args = validate_args(parse_args([*MINIMAL, "--train-iters", "2", "--recompute-activations"]), 1)
    assert args.recompute_granularity == "selective"
    args = validate_args(
        parse_args(
            [
                *MINIMAL,
                "--train-iters",
                "2",
                "--context-parallel-size",
                "2",
                "--attention-dropout",
                "0",
                "--cp-comm-type",
                "allgather",
                "allgather",
            ]
        ),
        2,
    )
    assert args.cp_comm_type == "all_gather"


def _lr_after(args, samples_per_step: int, steps: int) -> float:
    import torch

    from pentatron.pretrain.training import configs

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p]}], lr=args.lr)
    sched = configs.scheduler(args, opt)
    for _ in range(steps):
        sched.step(configs.scheduler_increment(args, samples_per_step))
    return opt.param_groups[0]["lr"]


def test_sample_based_schedule_counts_samples():
    """--train-samples: warm-up and decay in samples (Megatron's rule), the iteration count
    from the samples; lr after k iterations of 6 samples = the closed form at 6k samples."""
    base = [*MINIMAL, "--micro-batch-size", "3", "--global-batch-size", "6", "--lr", "1.0"]
    base += ["--min-lr", "0.0", "--lr-decay-style", "linear"]
    args = validate_args(
        parse_args(
            [
                *base,
                "--train-samples",
                "100",
                "--lr-warmup-samples",
                "9",
                "--lr-decay-samples",
                "60",
            ]
        ),
        2,
    )
    assert args.train_iters == 100 // 6
    assert _lr_after(args, 6, 1) == pytest.approx(6 / 9)  # warm-up: 6 of 9 samples
    # decay: (60 - 18) / (60 - 9) of the way from max to min at 18 samples
    assert _lr_after(args, 6, 3) == pytest.approx((60 - 18) / (60 - 9))
    assert _lr_after(args, 6, 11) == pytest.approx(0.0)  # 66 samples: past the decay
    with pytest.raises(ArgumentError, match="--lr-warmup-iters"):
        validate_args(parse_args([*base, "--train-samples", "100", "--lr-warmup-iters", "2"]), 2)
    with pytest.raises(ArgumentError, match="--lr-decay-samples"):
        validate_args(parse_args([*base, "--train-iters", "10", "--lr-decay-samples", "60"]), 2)


def test_rampup_in_samples_counts_megatrons_iterations():
    """Megatron's update_train_iters with --rampup-batch-size 2 2 8 and gbs 6 over 40 samples:
    the batch grows by 2 every 8 / ((6 - 2) / 2) = 4 samples; while consumed <= 8 the
    batches are 2 (at 0), 2 (at 2), 4 (at 4), 6 (at 8): 4 iterations, 14 samples; then
    (40 - 14) // 6 = 4 more: 8 iterations."""
    args = validate_args(
        parse_args(
            [
                *MINIMAL,
                "--micro-batch-size",
                "1",
                "--global-batch-size",
                "6",
                "--rampup-batch-size",
                "2",
                "2",
                "8",
                "--train-samples",
                "40",
            ]
        ),
        2,
    )
    assert args.train_iters == 8


def test_yaml_switch_keys_follow_the_flag(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("disable-bias-linear: true\nno-rope-fusion: true\ncp-comm-type: a2a\n")
    args = parse_args(["--config", str(cfg)])
    assert args.add_bias_linear is False and args.apply_rope_fusion is False
    assert args.cp_comm_type == ["a2a"]
    cfg.write_text("disable-bias-linear: false\n")
    assert parse_args(["--config", str(cfg)]).add_bias_linear is True
