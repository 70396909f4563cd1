"""The logging, profiling and gc flags (Megatron-LM's) change what a run writes and does.

Each test runs the app (the tiny GPT of `_app`, gloo ranks of the shared harness) with and
without a flag and checks what the flag is for: the params norm against torch's norm of the
trained model and across layouts, the TensorBoard scalars read back with tensorboard's
EventAccumulator, the profiler trace's files and steps, gc's state and collections, the
root logger's level. Expected values are computed here, never copied from the app.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _app import TINY_GPT

from pentatron.pretrain.arguments import ArgumentError, parse_args
from pentatron.pretrain.arguments_logging import logger_kwargs, validate_logging_args
from pentatron.pretrain.metrics import TrainingLogger

# Deterministic across layouts (no dropout) and on CPU (local layers).
APP = [
    *TINY_GPT,
    *("--transformer-impl", "local", "--max-position-embeddings", "16"),
    *("--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "7"),
]


def run_app(argv: list[str]) -> dict:
    """On each rank: the app with `argv`, recording per logged iteration whether gc was
    enabled and the root logger's level, and the generations of the collections that ran
    while automatic gc was disabled (only explicit ones can). At world 1 also torch's L2
    norm of the trained parameters (each Parameter once), the independent reference."""
    import gc

    import torch.distributed as dist

    from pentatron.parallel_state import destroy_model_parallel
    from pentatron.pretrain.arguments import validate_args
    from pentatron.pretrain.pretrain_gpt import default_logger, pretrain

    world = dist.get_world_size()
    args = validate_args(parse_args(argv), world)
    validate_logging_args(args, world, cuda=False)
    seen: dict = {"gc_enabled": [], "root_level": [], "collections": []}
    chunks: list = []

    def factory(args, grid, model_chunks):
        logger = default_logger(args, grid, model_chunks)
        chunks.extend(model_chunks)
        log_train = logger.log_train

        def recording(iteration, metrics):
            seen["gc_enabled"].append(gc.isenabled())
            seen["root_level"].append(logging.getLogger().level)
            log_train(iteration, metrics)

        logger.log_train = recording
        return logger

    def on_gc(phase, info):
        if phase == "start" and not gc.isenabled():
            seen["collections"].append(info["generation"])

    level = logging.getLogger().level
    gc.callbacks.append(on_gc)
    try:
        pretrain(args, logger_factory=factory)
        if world == 1:
            params = {id(p): p for c in chunks for p in c.module.parameters()}.values()
            flat = torch.cat([p.detach().double().flatten() for p in params])
            seen["torch_params_norm"] = float(torch.linalg.vector_norm(flat))
    finally:
        gc.callbacks.remove(on_gc)
        logging.getLogger().setLevel(level)
        destroy_model_parallel()
    seen["gc_enabled_after"] = gc.isenabled()
    return seen


def _records(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


# ---- --log-params-norm ---------------------------------------------------------------

NORM_RUN = [*APP, "--train-iters", "3", "--log-params-norm"]
# tp2: replicated params (norms, row-parallel biases) once; pp2: the tied embedding's
# second copy not at all; dp2 with ZeRO-1: the main params are dp shards, summed over dp.
NORM_LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2-distopt": ["--use-distributed-optimizer"],
}


@pytest.fixture(scope="module")
def norm_reference(distributed, tmp_path_factory):
    path = tmp_path_factory.mktemp("norm") / "metrics.jsonl"
    (seen,) = distributed.run(1, run_app, [*NORM_RUN, "--log-jsonl", str(path)])
    return _records(path), seen["torch_params_norm"]


def test_params_norm_is_torchs_norm_of_the_trained_model(norm_reference):
    records, torch_norm = norm_reference
    assert [r["iteration"] for r in records] == [1, 2, 3]
    norms = [r["params_norm"] for r in records]
    assert len(set(norms)) == 3  # after each step: the params moved
    assert norms[-1] == pytest.approx(torch_norm, rel=1e-6)


@pytest.mark.parametrize("layout", list(NORM_LAYOUTS))
def test_params_norm_counts_each_parameter_once_at_any_layout(
    distributed, norm_reference, tmp_path, layout
):
    path = tmp_path / "metrics.jsonl"
    distributed.run(2, run_app, [*NORM_RUN, *NORM_LAYOUTS[layout], "--log-jsonl", str(path)])
    got = [r["params_norm"] for r in _records(path)]
    want = [r["params_norm"] for r in norm_reference[0]]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=0.0)


# ---- TensorBoard: timers, memory, validation ppl, the per-iteration interval ---------


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


TB_RUN = [*APP, "--train-iters", "4", "--log-interval", "2"]
TB_RUN += ["--eval-iters", "1", "--eval-interval", "2"]
TB_FLAGS = [
    "--log-timers-to-tensorboard",
    "--log-memory-to-tensorboard",
    "--log-validation-ppl-to-tensorboard",
    "--log-throughput",
    *("--tensorboard-log-interval", "2"),
]


def test_tensorboard_flags_add_their_scalars(distributed, tmp_path):
    pytest.importorskip("tensorboard")
    plain, flagged = tmp_path / "plain", tmp_path / "flagged"
    distributed.run(1, run_app, [*TB_RUN, "--tensorboard-dir", str(plain)])
    jsonl = tmp_path / "metrics.jsonl"
    distributed.run(
        1,
        run_app,
        [*TB_RUN, *TB_FLAGS, "--tensorboard-dir", str(flagged), "--log-jsonl", str(jsonl)],
    )
    off, on = _scalars(plain), _scalars(flagged)
    flag_tags = {
        "iteration-time",
        "throughput",
        "throughput/tokens_per_s",
        "mem-allocated-bytes",
        "mem-max-allocated-bytes",
        "lm loss validation ppl",
        "lm loss validation ppl vs samples",
    }
    assert not flag_tags & set(off), "written without their flags"
    assert flag_tags <= set(on)
    # Megatron's default interval 1: every iteration's loss; with 2, every other one
    assert [step for step, _ in off["lm loss"]] == [1, 2, 3, 4]
    assert [step for step, _ in on["lm loss"]] == [2, 4]
    for ppl, loss in zip(on["lm loss validation ppl"], on["lm loss validation"]):
        assert ppl[0] == loss[0] and ppl[1] == pytest.approx(math.exp(loss[1]), rel=1e-6)
    assert [step for step, _ in on["iteration-time"]] == [2, 4]  # at the log intervals
    train = [r for r in _records(jsonl) if r["split"] == "train"]
    for (step, value), r in zip(on["iteration-time"], train):
        assert step == r["iteration"] and value == pytest.approx(r["iteration_time_s"], rel=1e-6)
    for (_, value), r in zip(on["throughput"], train):
        assert value == pytest.approx(r["tflops_per_device"], rel=1e-6)
    assert all(v > 2**20 for _, v in on["mem-allocated-bytes"])  # the process's RSS on CPU


def _logger(tmp_path, flags: list[str], stream) -> TrainingLogger:
    return TrainingLogger(
        log_interval=1,
        train_iters=1,
        jsonl_path=str(tmp_path / "m.jsonl"),
        tensorboard_dir=str(tmp_path / "tb"),
        enabled=True,
        progress=False,
        console=stream,
        flops_per_iteration=4e12,
        **logger_kwargs(parse_args(["--mock-data", *flags])),
    )


@pytest.mark.parametrize("flag", [False, True])
def test_log_throughput_puts_tflops_on_the_line(tmp_path, flag):
    stream = io.StringIO()
    logger = _logger(tmp_path, ["--log-throughput"] if flag else [], stream)
    logger.log_train(1, {"lm loss": 1.0, "lr": 1e-3, "skipped": 0, "elapsed_s": 2.0})
    logger.close()
    assert ("TFLOP/s/device: 2.0" in stream.getvalue()) is flag
    (record,) = _records(tmp_path / "m.jsonl")
    assert record["tflops_per_device"] == pytest.approx(2.0)  # the record always has it


def test_tensorboard_queue_size_reaches_the_writer(tmp_path):
    assert parse_args([]).tensorboard_queue_size == 1000  # Megatron's default
    logger = _logger(tmp_path, ["--tensorboard-queue-size", "7"], io.StringIO())
    (sink,) = logger._scalar_sinks
    assert sink.writer.max_queue == 7
    logger.close()


# ---- --profile ------------------------------------------------------------------------


def _trace_steps(path) -> tuple[set[str], set[str]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    names = {str(e.get("name")) for e in events}
    return {n for n in names if n.startswith("ProfilerStep#")}, names


def test_profile_traces_the_window_on_the_profile_ranks_only(distributed, tmp_path):
    tb = tmp_path / "tb"
    argv = [*APP, "--train-iters", "5", "--tensorboard-dir", str(tb), "--profile"]
    argv += ["--profile-step-start", "2", "--profile-step-end", "4", "--profile-ranks", "1"]
    distributed.run(2, run_app, argv)  # dp2
    traces = sorted((tb / "torch_profile").iterdir())
    assert [p.name.split(".")[0] for p in traces] == ["rank1"]
    assert traces[0].name.endswith(".pt.trace.json.gz")
    steps, names = _trace_steps(traces[0])
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}  # iterations [2, 4) as logged
    assert "aten::mm" in names or "aten::addmm" in names  # the model's matmuls were recorded


def test_without_profile_no_trace(distributed, tmp_path):
    tb = tmp_path / "tb"
    distributed.run(1, run_app, [*APP, "--train-iters", "3", "--tensorboard-dir", str(tb)])
    assert not (tb / "torch_profile").exists()


@pytest.mark.parametrize("use_pytorch_profiler", [False, True])
def test_profile_on_cuda_brackets_the_window_for_nsys(monkeypatch, tmp_path, use_pytorch_profiler):
    """Megatron's nsys range (cudaProfilerStart/Stop) around the same iterations, unless
    --use-pytorch-profiler. On this CPU machine CUDA's calls and torch.profiler are
    stand-ins that record what the profiler asks of them."""
    from pentatron.pretrain.training import profiling

    calls: list = []
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append("stop"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.profiler, "profile", _FakeProfile)
    flags = ["--profile", "--tensorboard-dir", str(tmp_path), "--profile-step-start", "2"]
    flags += [
        "--profile-step-end",
        "4",
        *(["--use-pytorch-profiler"] if use_pytorch_profiler else []),
    ]
    prof = profiling.make_step_profiler(parse_args(flags), 0, torch.device("cuda"))
    assert prof is not None
    for n in range(1, 6):
        prof.step(n)
        calls.append(n)
    prof.close()
    assert calls == ([1, 2, 3, 4, 5] if use_pytorch_profiler else [1, "start", 2, 3, "stop", 4, 5])
    assert profiling.make_step_profiler(parse_args(flags[1:]), 0, torch.device("cuda")) is None


class _FakeProfile:
    def __init__(self, **kwargs):
        self.step_num = 0

    def start(self):
        pass

    def step(self):
        self.step_num += 1

    def stop(self):
        pass


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--profile"], "--profile=True: the trace is written under --tensorboard-dir"),
        (
            ["--profile", "--tensorboard-dir", "tb", "--profile-step-end", "10"],
            "--profile-step-end=10: the window [--profile-step-start=10, end) holds no iteration",
        ),
        (
            ["--use-pytorch-profiler"],
            "--use-pytorch-profiler=True: it picks the profiler of --profile",
        ),
        (
            ["--profile-ranks", "0", "2"],
            "--profile-ranks=0 2: ranks [2] are not in this world of 2",
        ),
    ],
)
def test_bad_profile_flags_are_refused_in_one_line(flags, message):
    with pytest.raises(ArgumentError) as error:
        validate_logging_args(parse_args(flags), 2, cuda=False)
    assert str(error.value).startswith(message) and "fix: " in str(error.value)
    assert "\n" not in str(error.value)


# ---- --manual-gc, --logging-level ------------------------------------------------------

GC_RUN = [*APP, "--train-iters", "4", "--eval-iters", "1", "--eval-interval", "2"]


@pytest.mark.parametrize(
    ("flags", "collections"),
    [
        ([], []),  # automatic gc: nothing collects while it is disabled
        # start; iteration 2: interval, full before eval, young after; iteration 4: the
        # same, then the same around the validation and test evaluations after training
        (["--manual-gc", "--manual-gc-interval", "2"], [2, 2, 2, 0, 2, 2, 0, 2, 0, 2, 0]),
        (["--manual-gc", "--manual-gc-interval", "2", "--no-manual-gc-eval"], [2, 2, 2]),
        (["--manual-gc"], [2, 2, 0, 2, 0, 2, 0, 2, 0]),  # interval 0: no periodic collection
    ],
)
def test_manual_gc_disables_gc_and_collects_at_its_points(distributed, flags, collections):
    (seen,) = distributed.run(1, run_app, [*GC_RUN, *flags])
    assert seen["gc_enabled"] == [not flags] * 4
    assert seen["collections"] == collections
    assert seen["gc_enabled_after"]  # as it was before training


def test_logging_level_sets_the_root_logger(distributed):
    before = logging.getLogger().level
    (seen,) = distributed.run(1, run_app, [*APP, "--train-iters", "3", "--logging-level", "10"])
    assert seen["root_level"] == [logging.DEBUG] * 3
    (seen,) = distributed.run(1, run_app, [*APP, "--train-iters", "3"])
    assert seen["root_level"][0] != logging.DEBUG and before != logging.DEBUG


# ---- --empty-unused-memory-level --------------------------------------------------------


@pytest.mark.parametrize(
    ("level", "calls"), [(1, ["empty", "step"]), (2, ["empty", "step", "empty"])]
)
def test_empty_unused_memory_level_empties_the_cache_around_the_step(monkeypatch, level, calls):
    """Megatron's points on CUDA: after forward-backward (level 1) and after the optimizer
    step (level 2), and after evaluation; on CPU nothing is wrapped (no caching allocator)."""
    from pentatron.pretrain.training import hooks

    seen: list = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen.append("empty"))
    optimizer = SimpleNamespace(step=lambda: seen.append("step") or "result")
    args = parse_args(["--empty-unused-memory-level", str(level)])
    cuda = hooks.IterationHooks(args, SimpleNamespace(global_rank=0, device=torch.device("cuda")))
    assert cuda.optimizer(optimizer).step() == "result"
    assert seen == calls
    seen.clear()
    with cuda.evaluation():
        seen.append("eval")
    assert seen == ["eval", "empty"]
    cuda.close()
    cpu = hooks.IterationHooks(args, SimpleNamespace(global_rank=0, device=torch.device("cpu")))
    assert cpu.optimizer(optimizer) is optimizer
    off = parse_args([])
    assert off.empty_unused_memory_level == 0
    none = hooks.IterationHooks(off, SimpleNamespace(global_rank=0, device=torch.device("cuda")))
    assert none.optimizer(optimizer) is optimizer


# ---- --record-memory-history, --wandb-* -------------------------------------------------


def test_record_memory_history_is_refused_on_cpu():
    args = parse_args(["--record-memory-history"])
    for cuda, device in ((False, "auto"), (True, "cpu")):
        args.device = device
        with pytest.raises(ArgumentError) as error:
            validate_logging_args(args, 1, cuda=cuda)
        msg = str(error.value)
        assert msg.startswith("--record-memory-history=True: ") and "CUDA" in msg
        assert "fix: drop the flag on CPU" in msg and "\n" not in msg
    args.device = "auto"
    validate_logging_args(args, 1, cuda=True)  # on a GPU it is accepted


def test_wandb_without_the_package_is_refused_in_one_line(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "wandb" else find_spec(name, *a),
    )
    with pytest.raises(ArgumentError) as error:
        validate_logging_args(parse_args(["--wandb-project", "p"]), 1, cuda=False)
    msg = str(error.value)
    assert msg.startswith("--wandb-project=p: the wandb package is not installed; fix: pip install")
    assert "\n" not in msg
    validate_logging_args(parse_args([]), 1, cuda=False)  # no wandb flag: no check


class _FakeRun:
    def __init__(self, calls):
        self.calls = calls

    def log(self, values, step):
        self.calls.append(("log", step, values))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_flags_reach_wandb_init_and_the_scalars_are_logged(monkeypatch, tmp_path):
    """The wiring, with a stand-in `wandb` module (the real one is tested below when
    installed): wandb.init's keywords from the flags, the scalars at step = iteration."""
    calls: list = []
    fake = SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or _FakeRun(calls))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    save_dir = tmp_path / "wandb"
    flags = ["--wandb-project", "proj", "--wandb-exp-name", "run1", "--wandb-entity", "team"]
    flags += ["--wandb-save-dir", str(save_dir)]
    logger = TrainingLogger(
        log_interval=2,
        train_iters=2,
        jsonl_path=None,
        tensorboard_dir=None,
        enabled=True,
        progress=False,
        console=io.StringIO(),
        **logger_kwargs(parse_args(["--mock-data", *flags])),
    )
    for i in (1, 2):
        logger.log_train(i, {"lm loss": 3.0 - i, "lr": 0.1 * i, "skipped": 0, "elapsed_s": 0.5})
    logger.log_eval(2, {"lm loss": 1.5})
    logger.close()
    (_, init), *logs, end = calls
    assert {k: init[k] for k in ("project", "name", "entity", "dir")} == {
        "project": "proj",
        "name": "run1",
        "entity": "team",
        "dir": str(save_dir),
    }
    assert init["config"]["wandb_project"] == "proj" and save_dir.is_dir()
    steps = {}
    for _, step, values in logs:
        steps.setdefault(step, {}).update(values)
    assert steps[1]["lm loss"] == 2.0 and steps[2]["lm loss"] == 1.0  # every iteration
    assert steps[2]["learning-rate"] == pytest.approx(0.2)
    assert steps[2]["lm loss validation"] == 1.5
    assert not any(tag.endswith("vs samples") for v in steps.values() for tag in v)
    assert end == ("finish",)


def test_wandb_offline_run_is_written_locally(monkeypatch, tmp_path):
    wandb = pytest.importorskip("wandb")  # optional extra: skipped only when not installed
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    flags = [
        "--wandb-project",
        "proj",
        "--wandb-exp-name",
        "run1",
        "--wandb-save-dir",
        str(tmp_path),
    ]
    logger = TrainingLogger(
        log_interval=1,
        train_iters=1,
        jsonl_path=None,
        tensorboard_dir=None,
        enabled=True,
        progress=False,
        console=io.StringIO(),
        **logger_kwargs(parse_args(["--mock-data", *flags])),
    )
    logger.log_train(1, {"lm loss": 2.0, "lr": 0.1, "skipped": 0, "elapsed_s": 0.5})
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), wandb.__version__


# ---- defaults ------------------------------------------------------------------------


def test_defaults_are_megatrons():
    args = parse_args([])
    assert (args.log_interval, args.tensorboard_log_interval, args.tensorboard_queue_size) == (
        100,
        1,
        1000,
    )
    assert (args.profile_step_start, args.profile_step_end, args.profile_ranks) == (10, 12, [])
    assert args.memory_snapshot_path == "snapshot.pickle" and args.logging_level is None
    assert (args.manual_gc, args.manual_gc_interval, args.manual_gc_eval) == (False, 0, True)
    assert args.empty_unused_memory_level == 0
    off = ("log_throughput", "log_params_norm", "log_timers_to_tensorboard", "profile")
    assert not any(getattr(args, name) for name in off)
    assert parse_args(["--disable-manual-gc-eval"]).manual_gc_eval is False
    with pytest.raises(SystemExit):
        parse_args(["--empty-unused-memory-level", "3"])


@pytest.mark.parametrize("flag", [False, True])
def test_moe_per_layer_logging_flag_writes_per_layer_scalars(tmp_path, flag):
    """--moe-per-layer-logging reaches the logger: each layer's aux loss as its own scalar."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = _logger(tmp_path, ["--moe-per-layer-logging"] if flag else [], io.StringIO())
    metrics = {"lm loss": 1.0, "lr": 1e-3, "skipped": 0, "elapsed_s": 1.0}
    logger.log_train(1, {**metrics, "moe_losses": {"load_balancing_loss": [0.0, 2.0]}})
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = sorted(t for t in acc.Tags()["scalars"] if t.startswith("moe/"))
    assert tags == (
        ["moe/load_balancing_loss_layer_0", "moe/load_balancing_loss_layer_1"] if flag else []
    )
