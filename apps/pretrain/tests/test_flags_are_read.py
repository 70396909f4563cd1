"""Every flag the parser accepts is read by some code, and the flags below do what they say.

The walk: every dest of `build_parser()` must be read somewhere in the app's source, found
statically with `ast`: `args.<dest>` / `self.args.<dest>`, `getattr(args, "<dest>")`, and
`getattr(args, name)` where `name` runs over a literal tuple of dest names (the table that
builds TransformerConfig's MoE fields). Reads in validation count: there a flag is turned
into another (--lr-warmup-fraction -> lr_warmup_iters) or checked to be the one value we
support (--ckpt-format). Modules with their own ArgumentParser are skipped (their `args` is
another namespace). The remaining tests pin flags whose wiring no other test would notice
if dropped.
"""

from __future__ import annotations

import ast
import functools
import signal
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pentatron.pretrain import pretrain_gpt
from pentatron.pretrain.arguments import ArgumentError, build_parser, parse_args, validate_args
from pentatron.pretrain.training import configs
from pentatron.pretrain.training.loop import signal_catcher

SRC = Path(pretrain_gpt.__file__).parent

# Dests read by no `args.<dest>`, each consumed generically.
CONSUMED_GENERICALLY = {
    "help": "argparse's own action: prints the help and exits",
    "config": "parse_args reads it from a first pass (`first.config`) to load the YAML",
}


def _is_args(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "args") or (
        isinstance(node, ast.Attribute) and node.attr == "args"
    )


def _literal_strings(node: ast.AST, assigned: dict[str, ast.AST]) -> list[str]:
    if isinstance(node, ast.Name) and node.id in assigned:
        node = assigned[node.id]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant)]
    return []


def _reads_in_function(func: ast.AST) -> set[str]:
    """`getattr(args, n)` with `n` looping over a literal tuple (or a name bound to one)."""
    assigned = {
        t.id: node.value
        for node in ast.walk(func)
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    loops: dict[str, ast.AST] = {}
    for node in ast.walk(func):
        generators = getattr(node, "generators", None) or []
        targets = [(g.target, g.iter) for g in generators]
        if isinstance(node, ast.For):
            targets.append((node.target, node.iter))
        for target, it in targets:
            if isinstance(target, ast.Name):
                loops[target.id] = it
    out: set[str] = set()
    for node in ast.walk(func):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and _is_args(node.args[0])
            and isinstance(node.args[1], ast.Name)
            and node.args[1].id in loops
        ):
            out.update(_literal_strings(loops[node.args[1].id], assigned))
    return out


def _has_own_parser(tree: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "ArgumentParser"
        for n in ast.walk(tree)
    )


@functools.cache
def dests_read_in_source() -> frozenset[str]:
    read: set[str] = set()
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        if _has_own_parser(tree) and path.name != "arguments.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                if _is_args(node.value):
                    read.add(node.attr)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "getattr"
                and len(node.args) >= 2
                and _is_args(node.args[0])
                and isinstance(node.args[1], ast.Constant)
            ):
                read.add(node.args[1].value)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                read |= _reads_in_function(node)
    return frozenset(read)


def _compat_table_dests() -> set[str]:
    """Dests `resolve_compat` reads by looping over its NOTED / REFUSED tables (each entry
    is read with getattr and either named at start-up or refused when set)."""
    from pentatron.pretrain import arguments_compat

    return set(arguments_compat._NOTED) | set(arguments_compat._REFUSED)


def test_every_accepted_flag_is_read():
    dests = {a.dest for a in build_parser()._actions}
    read = dests_read_in_source() | _compat_table_dests()
    unread = sorted(dests - read - set(CONSUMED_GENERICALLY))
    assert not unread, (
        f"flags the parser accepts but no code reads: {unread}; read each with Megatron's "
        "meaning, or refuse it in validation naming the supported alternative"
    )
    assert set(CONSUMED_GENERICALLY) <= dests, "the allowlist names a flag that is gone"


def test_the_walk_sees_the_moe_table_and_misses_a_planted_flag():
    read = dests_read_in_source()
    assert {"moe_router_topk", "moe_grouped_gemm", "expert_tensor_parallel_size"} <= read
    assert "lr_warmup_fraction" in read  # read in validation, turned into lr_warmup_iters
    assert "planted_flag_nobody_reads" not in read


def test_every_flag_of_the_noted_table_names_itself_when_passed():
    """The walk counts the compat table's flags as read (Megatron's fusions we run unfused or
    inside SDPA, deprecated switches): they change nothing here, so each must say so.
    Every option string that moves one of them off Megatron's default prints a start-up
    note naming the flag; without it, no such note."""
    from pentatron.pretrain import arguments_compat

    quiet = _args().startup_notes
    options: dict[str, set[str]] = {}
    for action in build_parser()._actions:
        options.setdefault(action.dest, set()).update(action.option_strings)
    named = set()
    for action in build_parser()._actions:
        if action.dest not in arguments_compat._NOTED or action.nargs != 0:
            continue
        is_set = arguments_compat._NOTED[action.dest][0]
        flags = options[action.dest]
        assert not [n for n in quiet if n.split(":")[0] in flags], (action.dest, quiet)
        for opt in action.option_strings:
            args = _args(opt)
            if not is_set(getattr(args, action.dest)):
                continue  # the flag that keeps Megatron's default (--masked-softmax-fusion)
            notes = [n for n in args.startup_notes if n.split(":")[0] in flags]
            assert len(notes) == 1, (opt, args.startup_notes)
            named.add(action.dest)
    assert named == set(arguments_compat._NOTED)


# ----------------------------------------------------------------------------------------
# Flags that were accepted but not read.

MODEL = ["--lr", "3e-4", "--micro-batch-size", "2", "--num-layers", "4", "--hidden-size", "128"]
MODEL += ["--num-attention-heads", "4", "--seq-length", "128", "--max-position-embeddings", "128"]
BASE = ["--train-iters", "4", "--mock-data", *MODEL]


def _args(*flags: str, world: int = 1):
    return validate_args(parse_args([*BASE, *flags]), world)


def test_exit_signal_handler_catches_only_with_the_flag():
    """Megatron's default: off (the signals keep their default action)."""
    before = signal.getsignal(signal.SIGTERM)
    catcher = signal_catcher(_args("--exit-signal-handler"))
    try:
        assert signal.getsignal(signal.SIGTERM) == catcher._handle
        signal.raise_signal(signal.SIGTERM)
        assert catcher.received == signal.SIGTERM
    finally:
        catcher.restore()
    assert signal.getsignal(signal.SIGTERM) == before
    assert _args().exit_signal_handler is False
    catcher = signal_catcher(_args())
    try:
        assert signal.getsignal(signal.SIGTERM) == before
        assert signal.getsignal(signal.SIGINT) != catcher._handle
    finally:
        catcher.restore()


@pytest.mark.parametrize("fmt", ["torch", "zarr", "torch_dcp"])
def test_ckpt_format_other_than_torch_dist_is_refused(fmt):
    assert _args("--ckpt-format", "torch_dist").ckpt_format == "torch_dist"
    with pytest.raises(ArgumentError) as e:
        _args("--ckpt-format", fmt)
    msg = str(e.value)
    assert msg.startswith(f"--ckpt-format={fmt}:") and "torch_dist" in msg and "\n" not in msg


def test_yaml_value_outside_the_flag_choices_is_refused(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("optimizer: adamw\n")
    with pytest.raises(
        ArgumentError, match=r"'optimizer': 'adamw' is not one of \['adam', 'sgd'\]"
    ):
        parse_args(["--config", str(cfg)])
    cfg.write_text("ckpt-format: torch\n")
    with pytest.raises(ArgumentError, match=r"--ckpt-format=torch: .*torch_dist"):
        validate_args(parse_args(["--config", str(cfg), *BASE]), 1)


# ----------------------------------------------------------------------------------------
# Flags that were read but untested: each test fails if the flag is ignored.


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return None


@pytest.mark.parametrize("flag", [False, True])
def test_no_save_optim_saves_without_the_optimizer(monkeypatch, flag):
    from pentatron.pretrain import checkpointing

    record = _Recorder()
    monkeypatch.setattr(checkpointing, "save_checkpoint", record)
    args = _args("--save", "/unused", *(["--no-save-optim"] if flag else []))
    optimizer = object()
    save = pretrain_gpt._saver(args, [], optimizer, None, grid=None, config=None)
    save(SimpleNamespace(iteration=3, consumed_samples=12))
    ((positional, _),) = record.calls
    assert positional[3] is (None if flag else optimizer)


@pytest.mark.parametrize("flags", [[], ["--no-load-rng"], ["--no-load-optim", "--no-load-rng"]])
def test_no_load_rng_and_no_load_optim_reach_load_checkpoint(monkeypatch, flags):
    from pentatron.pretrain import checkpointing

    record = _Recorder()
    monkeypatch.setattr(checkpointing, "load_checkpoint", record)
    assert pretrain_gpt._load(_args(*flags), [], None, None, None, None) is None
    assert record.calls == []  # no --load: nothing loaded
    pretrain_gpt._load(_args("--load", "/unused", *flags), [], None, None, None, None)
    ((_, kwargs),) = record.calls
    assert kwargs["load_rng"] is ("--no-load-rng" not in flags)
    assert kwargs["load_optim"] is ("--no-load-optim" not in flags)


class _Chunk:
    def __init__(self, grad):
        self.grad = grad

    def local_grads(self):
        return [self.grad]


@pytest.mark.parametrize("check", [True, False])
def test_no_check_for_nan_in_loss_and_grad_skips_the_grad_check(monkeypatch, check):
    """The step's verdict with a NaN grad and a finite loss: bad only when grads are checked."""
    from pentatron.pretrain.training import step

    monkeypatch.setattr(step.comm, "all_reduce", lambda t, **kw: t)  # one process
    monkeypatch.setattr(
        step, "run_schedule", lambda *a, **kw: [{"lm loss": torch.tensor([2.0, 1.0])}]
    )
    monkeypatch.setattr(step, "_loss_pair", lambda reduced, grid, zbv=False: None)
    args = _args(*([] if check else ["--no-check-for-nan-in-loss-and-grad"]))
    chunk = _Chunk(torch.tensor([1.0, float("nan")]))
    chunk.zero_grad_buffer = lambda: None
    stepped = []
    optimizer = SimpleNamespace(
        step=lambda: (
            stepped.append(1)
            or SimpleNamespace(
                update_successful=True, grad_norm=1.0, num_zeros_in_grad=None, loss_scale=None
            )
        )
    )
    grid = SimpleNamespace(device=torch.device("cpu"))
    out = step.train_step(args, [chunk], [None], None, optimizer, None, grid, 1)
    assert out.finite is (not check)
    assert stepped == ([] if check else [1])


def test_num_workers_reaches_the_data_loader():
    grid = SimpleNamespace(rank=lambda axis: 0, size=lambda axis: 1, device=torch.device("cpu"))
    dataset = list(range(16))
    for workers in (0, 2):
        args = _args("--num-workers", str(workers))
        loader = pretrain_gpt._loader_factory(args, grid, dataset, 0)()
        assert loader.num_workers == workers


def test_distributed_timeout_minutes_reaches_the_process_groups_config():
    assert configs.parallel_config(_args()).timeout == timedelta(minutes=10)
    timeout = configs.parallel_config(_args("--distributed-timeout-minutes", "0.5")).timeout
    assert timeout == timedelta(seconds=30)


def test_lr_warmup_init_is_the_first_lr_of_the_warmup():
    param = torch.nn.Parameter(torch.zeros(2))
    for init in (0.0, 1e-5):
        optimizer = torch.optim.SGD([param], lr=1.0)
        args = _args("--lr", "1e-3", "--lr-warmup-iters", "2", "--lr-warmup-init", str(init))
        configs.scheduler(args, optimizer)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(init, abs=1e-12)


def test_data_cache_path_holds_the_dataset_index_cache(tmp_path):
    from pentatron.pretrain.data.indexed_dataset import build_from_documents

    rng = np.random.default_rng(0)
    docs = [[*rng.integers(1, 200, size=30).tolist(), 0] for _ in range(40)]
    prefix = tmp_path / "data" / "d"
    build_from_documents(prefix, docs, dtype=np.uint16)
    cache = tmp_path / "elsewhere"
    args = validate_args(
        parse_args(
            [
                *MODEL,
                *("--train-iters", "2", "--data-path", str(prefix), "--seq-length", "16"),
                *("--tokenizer-type", "NullTokenizer", "--vocab-size", "256"),
                *("--eval-iters", "0", "--data-cache-path", str(cache)),
            ]
        ),
        1,
    )
    tokenizer = SimpleNamespace(eod=0, pad=0, vocab_size=256)
    train, _, _ = pretrain_gpt.datasets_provider(
        args, tokenizer, (8, 0, 0), SimpleNamespace(host_group=None)
    )
    assert train is not None and len(list(cache.rglob("*.npy"))) >= 3
    assert not list((tmp_path / "data").rglob("*.npy"))  # not next to the data


@pytest.mark.parametrize("flags, mapped", [([], True), (["--no-mmap-bin-files"], False)])
def test_no_mmap_bin_files_reads_the_tokens_into_memory(tmp_path, flags, mapped):
    """Megatron's --no-mmap-bin-files: the .bin is read into memory, not mapped; the samples
    are the same either way."""
    from pentatron.pretrain.data.indexed_dataset import build_from_documents

    rng = np.random.default_rng(1)
    docs = [[*rng.integers(1, 200, size=30).tolist(), 0] for _ in range(40)]
    prefix = tmp_path / "d"
    build_from_documents(prefix, docs, dtype=np.uint16)
    argv = [*MODEL, "--train-iters", "2", "--data-path", str(prefix), "--seq-length", "16"]
    argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--eval-iters", "0"]
    args = validate_args(parse_args([*argv, *flags]), 1)
    tokenizer = SimpleNamespace(eod=0, pad=0, vocab_size=256)
    train, _, _ = pretrain_gpt.datasets_provider(
        args, tokenizer, (8, 0, 0), SimpleNamespace(host_group=None)
    )
    assert isinstance(train.dataset._bin, np.memmap) is mapped
    reference = pretrain_gpt.datasets_provider(
        validate_args(parse_args(argv), 1), tokenizer, (8, 0, 0), SimpleNamespace(host_group=None)
    )[0]
    for i in range(4):
        assert np.array_equal(train[i]["tokens"], reference[i]["tokens"])
