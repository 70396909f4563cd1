"""Flags of logging, profiling and run hygiene (Megatron-LM's names, types and defaults).

`add_logging_args` adds them to the parser; `validate_logging_args` checks them (no process
group needed, one line per refusal); `logger_kwargs` turns them into `TrainingLogger`'s
keywords. What each flag does at run time lives in `metrics/` (what is written) and
`training/hooks.py` (what the loop does around each iteration).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Any

from .arguments_validate import ArgumentError


def add_logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--log-jsonl", default=None, help="metrics file (default: in --save)")
    g.add_argument("--no-progress", action="store_true", help="plain lines, no live bar")
    g.add_argument(
        "--log-throughput",
        action="store_true",
        help="print TFLOP/s per device on the log line (and, with --log-timers-to-tensorboard, "
        "write it to TensorBoard); the JSONL record always holds it",
    )
    g.add_argument(
        "--log-params-norm",
        action="store_true",
        help="compute the L2 norm of all parameters after every step (each counted once "
        "across tp/pp/ep/dp, like the grad norm) and log it",
    )
    g.add_argument(
        "--tensorboard-log-interval",
        type=int,
        default=1,
        help="write the per-iteration scalars (loss, lr, grad norm, ...) every this many iterations",
    )
    g.add_argument(
        "--tensorboard-queue-size",
        type=int,
        default=1000,
        help="TensorBoard events queued before a write to disk (also written at each log interval)",
    )
    g.add_argument(
        "--log-timers-to-tensorboard",
        action="store_true",
        help="write iteration-time and tokens/s (and TFLOP/s with --log-throughput) to TensorBoard",
    )
    g.add_argument(
        "--log-validation-ppl-to-tensorboard",
        action="store_true",
        help="write the validation perplexity to TensorBoard",
    )
    g.add_argument(
        "--moe-per-layer-logging",
        action="store_true",
        help="write each layer's MoE aux losses (moe/<name>_layer_<i>) to TensorBoard / W&B",
    )
    g.add_argument(
        "--log-memory-to-tensorboard",
        action="store_true",
        help="write memory scalars to TensorBoard (CUDA: the caching allocator's stats; "
        "CPU: the process's resident set size)",
    )
    g.add_argument(
        "--logging-level",
        type=int,
        default=None,
        help="level of Python's root logger (10 DEBUG, 20 INFO, 30 WARNING, ...)",
    )
    g.add_argument(
        "--wandb-project",
        default=None,
        help="log the scalars to Weights & Biases in this project (needs the wandb package: "
        "pip install 'pentatron-pretrain[wandb]'; WANDB_MODE=offline writes locally only)",
    )
    g.add_argument("--wandb-exp-name", default=None, help="the wandb run name")
    g.add_argument(
        "--wandb-save-dir", default=None, help="wandb's local folder (default: <--save>/wandb)"
    )
    g.add_argument("--wandb-entity", default=None, help="the wandb entity (team or user)")

    g = p.add_argument_group("profiling")
    g.add_argument(
        "--profile",
        action="store_true",
        help="record a torch.profiler trace of iterations [--profile-step-start, "
        "--profile-step-end) (as the log line numbers them) on --profile-ranks, written to "
        "<--tensorboard-dir>/torch_profile/rank<r>.<ns>.pt.trace.json.gz (TensorBoard's "
        "profiler plugin, Perfetto or chrome://tracing open it). On CUDA the window is also "
        "bracketed by cudaProfilerStart/Stop for `nsys --capture-range=cudaProfilerApi`, "
        "unless --use-pytorch-profiler",
    )
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument(
        "--use-pytorch-profiler",
        action="store_true",
        help="with --profile: the torch.profiler trace only (no cudaProfilerStart/Stop)",
    )
    g.add_argument(
        "--profile-ranks",
        type=int,
        nargs="+",
        default=[],
        help="global ranks that profile and record memory history (default: all)",
    )
    g.add_argument(
        "--record-memory-history",
        action="store_true",
        help="CUDA only: record the caching allocator's history from the start of training "
        "and dump a snapshot at every log interval (open it at pytorch.org/memory_viz)",
    )
    g.add_argument(
        "--memory-snapshot-path",
        default="snapshot.pickle",
        help="where --record-memory-history dumps; rank r writes <stem>_<r><suffix>",
    )

    g = p.add_argument_group("garbage collection and memory")
    g.add_argument(
        "--manual-gc",
        action="store_true",
        help="disable Python's automatic gc during training and collect at fixed points "
        "(start, every --manual-gc-interval iterations, around evaluation), the same on every rank",
    )
    g.add_argument("--manual-gc-interval", type=int, default=0, help="0: no periodic collection")
    g.add_argument(
        "--no-manual-gc-eval",
        "--disable-manual-gc-eval",
        dest="manual_gc_eval",
        action="store_false",
        help="with --manual-gc, do not collect before and after each evaluation",
    )
    g.add_argument(
        "--empty-unused-memory-level",
        type=int,
        default=0,
        choices=[0, 1, 2],
        help="torch.cuda.empty_cache() 1: after forward-backward and after evaluation, "
        "2: also after the optimizer step (a no-op on CPU, which has no caching allocator)",
    )


def _fail(flag: str, value: object, rule: str, fix: str) -> None:
    raise ArgumentError(f"--{flag}={value}: {rule}; fix: {fix}")


def validate_logging_args(args: argparse.Namespace, world_size: int, cuda: bool) -> None:
    """The logging flags' rules, before any process group (`cuda`: torch sees a GPU)."""
    for name in ("tensorboard_log_interval", "tensorboard_queue_size"):
        if getattr(args, name) < 1:
            flag = name.replace("_", "-")
            _fail(flag, getattr(args, name), "must be >= 1", "pass a positive integer")
    if args.manual_gc_interval < 0:
        _fail(
            "manual-gc-interval",
            args.manual_gc_interval,
            "must be >= 0",
            "pass 0 (no periodic collection) or a positive interval",
        )
    bad_ranks = [r for r in args.profile_ranks if not 0 <= r < world_size]
    if bad_ranks:
        _fail(
            "profile-ranks",
            " ".join(map(str, args.profile_ranks)),
            f"ranks {bad_ranks} are not in this world of {world_size}",
            f"pass global ranks in 0..{world_size - 1}",
        )
    if args.profile:
        _profile(args)
    elif args.use_pytorch_profiler:
        _fail(
            "use-pytorch-profiler",
            True,
            "it picks the profiler of --profile, which is not set",
            "add --profile (or drop --use-pytorch-profiler)",
        )
    if args.record_memory_history and (not cuda or args.device == "cpu"):
        _fail(
            "record-memory-history",
            True,
            "torch.cuda.memory._record_memory_history records the CUDA caching allocator, "
            "and this run is on CPU",
            "drop the flag on CPU (run on a GPU to record memory history)",
        )
    if args.wandb_project is not None:
        _wandb(args)


def _profile(args: argparse.Namespace) -> None:
    start, end = args.profile_step_start, args.profile_step_end
    if start < 0:
        _fail("profile-step-start", start, "must be >= 0", "pass an iteration number")
    if end <= start:
        _fail(
            "profile-step-end",
            end,
            f"the window [--profile-step-start={start}, end) holds no iteration",
            f"pass an end above {start}",
        )
    if not args.tensorboard_dir:
        _fail(
            "profile",
            True,
            "the trace is written under --tensorboard-dir, which is not set",
            "add --tensorboard-dir DIR",
        )


def _wandb(args: argparse.Namespace) -> None:
    if not args.wandb_project:
        _fail("wandb-project", "''", "an empty project name", "pass a name or drop the flag")
    if args.wandb_exp_name == "":
        _fail("wandb-exp-name", "''", "an empty run name", "pass a name or drop the flag")
    if importlib.util.find_spec("wandb") is None:
        _fail(
            "wandb-project",
            args.wandb_project,
            "the wandb package is not installed",
            "pip install 'pentatron-pretrain[wandb]' (or pip install wandb), or drop the flag",
        )


def logger_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`TrainingLogger`'s keywords that these flags set (the run's output choices)."""
    wandb_init = None
    if args.wandb_project:
        save_dir = args.wandb_save_dir or (
            os.path.join(args.save, "wandb") if args.save else None
        )  # None: wandb's own ./wandb
        wandb_init = {
            "project": args.wandb_project,
            "name": args.wandb_exp_name,
            "dir": save_dir,
            "entity": args.wandb_entity,
            "config": dict(vars(args)),
        }
    return {
        "log_throughput": args.log_throughput,
        "log_timers_to_tensorboard": args.log_timers_to_tensorboard,
        "log_memory_to_tensorboard": args.log_memory_to_tensorboard,
        "log_validation_ppl_to_tensorboard": args.log_validation_ppl_to_tensorboard,
        "moe_per_layer_logging": args.moe_per_layer_logging,
        "tensorboard_log_interval": args.tensorboard_log_interval,
        "tensorboard_queue_size": args.tensorboard_queue_size,
        "wandb_init": wandb_init,
    }
