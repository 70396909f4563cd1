"""`pentatron-memory`: GPU memory per pipeline stage for a pentatron-pretrain run.

    pentatron-memory --preset gpt3-175b --world-size 1024 --tensor-model-parallel-size 8 \
        --pipeline-model-parallel-size 8 --sequence-parallel --use-distributed-optimizer \
        --recompute-granularity selective --bf16 --micro-batch-size 1 \
        --global-batch-size 1536 --device-memory-gb 79.6 [--json] [--plot out.png]

Takes pentatron-pretrain's flags and `--config file.yaml` (the app's parser and
`validate_args`, so an impossible layout fails with the app's message), or a `--preset` /
`--hf-config` for the model. A preset's / HF config's values are defaults: any flag given
on the command line or as a `--config` key wins, even when it equals the app's default.
MoE and context parallelism take the app's flags (`--num-experts`,
`--moe-token-dispatcher-type`, `--expert-model-parallel-size`, `--context-parallel-size`,
`--cp-comm-type`, ...) and its validation; a preset's MoE fields fill the MoE flags not
given. `--device-memory-gb` is in GiB (2^30 bytes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from ..arguments import ArgumentError, build_parser, validate_args, yaml_defaults
from .plan import MemoryPlan, MemoryPlanError, derive_dp, plan_from_args
from .presets import from_hf_config, preset
from .report import memory_report, plot, print_table


def _parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.prog = "pentatron-memory"
    p.description = (
        "Memory per GPU and pipeline stage for a pentatron-pretrain run (the same flags; "
        "--lr is not needed, --micro-batch-size defaults to 1 and --max-position-embeddings to "
        "--seq-length)."
    )
    g = p.add_argument_group("memory calculator")
    g.add_argument(
        "--preset", default=None, help="gpt3-175b, llama3-8b/70b/405b, mixtral-8x7b, deepseek-v3"
    )
    g.add_argument("--hf-config", default=None, help="a Hugging Face config.json")
    g.add_argument("--world-size", type=int, default=None, help="default: tp*pp*cp (dp 1)")
    g.add_argument(
        "--device-memory-gb",
        type=float,
        default=None,
        help="memory per GPU in GiB (2**30 bytes, despite the name): nvidia-smi's MiB total "
        "/ 1024, e.g. 79.6 for an H100 80GB; headroom = this - total",
    )
    g.add_argument("--json", action="store_true", help="print the stages as JSON")
    g.add_argument("--plot", default=None, help="write a stacked bar chart (PNG)")
    return p


def _given(parser: argparse.ArgumentParser, argv: list[str], yaml_keys: set[str]) -> set[str]:
    """Dests the user gave: on the command line or as `--config` keys. They win over the
    preset / HF config even when the value equals the parser default, so "given" is read
    from the argv tokens (argparse's own matching, so `--flag=v` counts)
    into a namespace pre-filled with a marker, never by comparing values with defaults."""
    unset = object()
    marked = argparse.Namespace(**{a.dest: unset for a in parser._actions})
    parser.parse_known_args(argv, namespace=marked)
    return {k for k, v in vars(marked).items() if v is not unset} | yaml_keys


def build_plan(argv: list[str]) -> tuple[MemoryPlan, argparse.Namespace]:
    """Parse, apply preset/HF config, validate with the app's rules; the plan and args.

    Precedence: command line > `--config` YAML > preset / HF config > the app's defaults."""
    parser = _parser()
    first, _ = parser.parse_known_args(argv)
    yaml_keys: set[str] = set()
    if first.config:
        from_yaml = yaml_defaults(parser, first.config)
        parser.set_defaults(**from_yaml)
        yaml_keys = set(from_yaml)
        first, _ = parser.parse_known_args(argv)  # --preset / --hf-config may be YAML keys
    model: dict[str, Any] = {}
    moe: dict[str, Any] = {}
    if first.preset and first.hf_config:
        raise MemoryPlanError("--preset and --hf-config are exclusive; fix: pass one")
    if first.preset:
        model, moe = preset(first.preset)
    elif first.hf_config:
        model, moe = from_hf_config(first.hf_config)
    args = parser.parse_args(argv)
    given = _given(parser, argv, yaml_keys)
    if first.hf_config and "seq_length" not in given and "seq_length" in model:
        print(
            f"pentatron-memory: --seq-length not given; sizing s={model['seq_length']} "
            "(max_position_embeddings of the config); pass --seq-length for a shorter "
            "training sequence",
            file=sys.stderr,
        )
    for k, v in model.items():
        if k not in given:
            setattr(args, k, v)
    return _validated(args, moe, given)


def _validated(
    args: argparse.Namespace, moe: dict, given: set[str]
) -> tuple[MemoryPlan, argparse.Namespace]:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp, ep = args.context_parallel_size, args.expert_model_parallel_size
    world = tp * pp * cp if args.world_size is None else args.world_size
    dp = derive_dp(world, tp, pp, cp, ep, args.expert_tensor_parallel_size or tp)
    # A preset's / HF config's MoE fields fill the app's flags the user did not give, so
    # validate_args checks the whole MoE and cp layout with the app's own rules.
    late = {}
    for field, value in moe.items():
        flag = "num_experts" if field == "num_moe_experts" else field
        if flag in given:
            continue
        if not hasattr(args, flag) or isinstance(value, list):
            late[field] = value  # e.g. a per-layer moe_layer_freq list: set on the config
        else:
            setattr(args, flag, value)
    if args.train_iters is None and args.train_samples is None:
        args.train_iters = 1
    # The app requires these; memory does not depend on the lr, and the position table is
    # sized by --max-position-embeddings, which here defaults to the sequence length.
    if args.lr is None:
        args.lr = 0.0
    if args.micro_batch_size is None:
        args.micro_batch_size = 1
    if args.max_position_embeddings is None and args.seq_length is not None:
        args.max_position_embeddings = args.seq_length
    args.mock_data = True
    validate_args(args, world, cuda=True, have_te=True)  # sizing the GPU run, wherever it runs
    plan = plan_from_args(args)
    plan.config = dataclasses.replace(plan.config, **late)
    plan.dp = dp
    plan.name = args.preset or args.hf_config or "custom"
    if plan.config.is_moe and plan.config.num_moe_experts % ep:
        raise MemoryPlanError(
            f"--expert-model-parallel-size={ep}: must divide the {plan.config.num_moe_experts} "
            "experts; fix: pick a divisor"
        )
    return plan, args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        plan, args = build_plan(argv)
        stages = memory_report(plan, args.device_memory_gb)  # a layout it cannot size: raises
    except (ArgumentError, MemoryPlanError, ValueError) as exc:
        print(f"pentatron-memory: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([dataclasses.asdict(s) for s in stages], indent=1))
    else:
        print_table(plan, stages)
    if args.plot:
        plot(plan, stages, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
