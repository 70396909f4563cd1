"""--compile: torch.compile of each transformer layer gives eager's numbers, in one graph.

The parity runs use the "aot_eager" backend: Dynamo and AOTAutograd trace and partition the
layer as they do for Inductor (the parts that meet our autograd functions, DDP's hooks,
main_grad and the collectives), without generating C++, which would take minutes on 8 CPU
ranks. Four steps at tp2-pp2(vpp2)-dp2 with SP, ZeRO-1 and overlapped grad reduce and param
gather, and at cp2 (a2a) with FSDP2, full recomputation and an evaluation: every step's
loss and grad norm (and the eval loss) equal the eager run's (fp32; rtol 1e-5, though the
same kernels run and they are equal in practice). One small run goes through real Inductor (1 process, tp1,
3 steps; rtol 1e-4: Inductor fuses and reorders sums). Each run also counts what Dynamo did:
no graph break, and the layers share their compiled code (re-specialised only for eval,
recomputation's no-grad forward and the first stage's rotary tables, not per layer).
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _app import TINY_GPT, TP2_PP2_VPP2_SP_ZERO1

COMMON = [*TINY_GPT, "--group-query-attention", "--num-query-groups", "2", "--seed", "7"]
LAYOUTS = {
    # 8 ranks: the pipeline schedule with virtual stages, SP, ZeRO-1 and both overlaps
    "tp2-pp2-vpp2-dp2-sp-distopt": [
        *TP2_PP2_VPP2_SP_ZERO1,
        "--train-iters",
        "4",
    ],
    # 2 ranks: context parallelism (a2a) with FSDP2 over dp x cp in place of DDP, full
    # recomputation (a no-grad forward, then the forward again in backward) and an
    # evaluation (the layers in eval mode)
    "cp2-a2a-fsdp2-recompute": [
        "--context-parallel-size",
        "2",
        "--cp-comm-type",
        "a2a",
        "--use-torch-fsdp2",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
        "--train-iters",
        "4",
        "--eval-interval",
        "2",
        "--eval-iters",
        "1",
    ],
}
# (ranks, transformer layers per rank, most graphs a rank may compile). The layers share
# one compiled code; Dynamo specialises it again, once and not per layer, for eval, for the
# no-grad forward of recomputation and, on the first pipeline stage, for the embedding's
# [s, b, 1, d] rotary tables (later chunks get [s, 1, 1, d]). Past its limit of 8 versions
# a layer would silently run eagerly.
WORLD = {"tp2-pp2-vpp2-dp2-sp-distopt": (8, 2, (2, 1)), "cp2-a2a-fsdp2-recompute": (2, 4, (3, 3))}
AOT = ["--compile", "--compile-backend", "aot_eager"]


class _Metrics:
    """A logger that keeps each step's (loss, grad norm) and the eval losses."""

    def __init__(self) -> None:
        self.train: list[tuple[float, float]] = []
        self.eval: list[float] = []

    def log_train(self, iteration: int, m: dict) -> None:
        self.train.append((m["lm loss"], m["grad_norm"]))

    def log_eval(self, iteration: int, m: dict, label: str = "validation") -> None:
        self.eval.append(m["lm loss"])

    def close(self) -> None:
        pass


def _train(argv: list[str]) -> dict:
    """One run on this worker's ranks: the metrics, and what Dynamo compiled."""
    import torch._dynamo
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from pentatron.parallel_state import destroy_model_parallel
    from pentatron.pretrain.arguments import parse_args, validate_args
    from pentatron.pretrain.pretrain_gpt import pretrain
    from pentatron.pretrain.training.compile import is_compiled

    torch._dynamo.reset()  # the workers persist across tests: count this run only
    counters.clear()
    metrics, chunks, pending = _Metrics(), [], []

    def logger(args, grid, wrapped):
        chunks.extend(wrapped)
        for chunk in wrapped:  # eager, before the layers: is a param all-gather in flight?
            spy = partial(_param_gather_pending, chunk, pending)
            chunk.module.decoder.register_forward_pre_hook(spy)
        return metrics

    args = validate_args(parse_args(argv), dist.get_world_size())
    try:
        pretrain(args, logger_factory=logger)
    finally:
        destroy_model_parallel()
    return {
        "train": metrics.train,
        "eval": metrics.eval,
        "compiled": [is_compiled(layer) for c in chunks for layer in c.module.decoder.layers],
        "graph_breaks": sum(counters["graph_break"].values()),
        "frames": counters["frames"]["total"],
        "frames_ok": counters["frames"]["ok"],
        "graphs": counters["stats"]["unique_graphs"],
        "gather_pending": any(pending),
    }


def _param_gather_pending(chunk, pending: list, module, args) -> None:
    """--overlap-param-gather: whether some bucket's param all-gather is still un-waited
    (DDP; an FSDP2 chunk gathers per layer itself)."""
    buckets = [b for buffer in getattr(chunk, "all_buffers", ()) for b in buffer.buckets]
    pending.append(any(b.param_handle is not None for b in buckets))


def _assert_close(got: dict, want: dict, rtol: float) -> None:
    g, w = torch.tensor(got["train"]), torch.tensor(want["train"])
    # column 0: the loss (NaN off the last pipeline stage, the same in both), 1: grad norm
    torch.testing.assert_close(g, w, rtol=rtol, atol=0.0, equal_nan=True)
    torch.testing.assert_close(got["eval"], want["eval"], rtol=rtol, atol=0.0, equal_nan=True)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_layers_give_the_eager_losses_and_grad_norms(distributed, layout):
    argv, (world, layers, graphs) = COMMON + LAYOUTS[layout], WORLD[layout]
    eager = distributed.run(world, _train, argv)
    compiled = distributed.run(world, _train, argv + AOT)
    assert eager[-1]["train"][-1][0] < eager[-1]["train"][0][0]  # it learns
    if "--overlap-param-gather" in argv:  # eagerly the layers' own hooks wait, later
        assert any(e["gather_pending"] for e in eager)
    for rank, (c, e) in enumerate(zip(compiled, eager)):
        assert e["compiled"] == [False] * layers and e["frames"] == 0
        assert c["compiled"] == [True] * layers, rank
        _assert_close(c, e, rtol=1e-5)
        # The layers read their params only after their all-gather finished (DDP waits
        # before compiled code: the waits in its per-module hooks cannot be traced).
        assert not c["gather_pending"], rank
        # no graph break: each layer is one graph, its collectives (tp, cp) inside
        assert c["graph_breaks"] == 0 and c["frames_ok"] == c["frames"], (rank, c)
        first_stage = rank < 4  # pp rank 0 (at pp2 ranks 0-3; at pp1 all)
        assert 1 <= c["graphs"] <= graphs[0 if first_stage else 1], (rank, c)


def test_inductor_compiles_all_layers_into_one_graph(distributed):
    argv = [*COMMON, "--train-iters", "3"]
    eager = distributed.run(1, _train, argv)[0]
    compiled = distributed.run(1, _train, [*argv, "--compile"])[0]  # inductor, the default
    _assert_close(compiled, eager, rtol=1e-4)
    assert compiled["compiled"] == [True] * 4
    # tp1: the four layers run one compiled frame with one graph, no break, no recompile
    assert (compiled["graph_breaks"], compiled["frames"], compiled["graphs"]) == (0, 1, 1)


BF16 = [*COMMON, "--bf16", "--train-iters", "3", "--tensor-model-parallel-size", "2"]
BF16 += ["--sequence-parallel", "--use-distributed-optimizer"]


def _train_dw_returned(argv: list[str]) -> dict:
    """`_train` with tp-layers' compiled path before 0.1.8 planted: a traced backward
    returns dW (bf16 under --bf16) for DDP's hook to add to main_grad."""
    from pentatron.tp_layers.layers import linear

    fused = linear._weight_grad

    def returned(weight, grad_2d, input_2d, fuse, traced=False):
        return grad_2d.t().matmul(input_2d) if traced else fused(weight, grad_2d, input_2d, fuse)

    linear._weight_grad = returned
    try:
        return _train(argv)
    finally:
        linear._weight_grad = fused


def test_compiled_bf16_layers_accumulate_dw_in_fp32_as_eager_ones(distributed):
    """--bf16 at tp2 with SP and ZeRO-1, 8 micro-batches a step: the compiled layers
    accumulate each micro-batch's dW into the fp32 main_grad with eager's kernel (an
    operator of the traced backward), so losses and grad norms equal eager's (measured
    equal; rtol 1e-6). Handing dW to DDP's hook in bf16 instead, as compiled layers did,
    rounds every micro-batch's dW: the grad norm is then off by 4.9e-4 (step 3), which
    this comparison catches (planted)."""
    eager = distributed.run(2, _train, BF16)
    compiled = distributed.run(2, _train, BF16 + AOT)
    planted = distributed.run(2, _train_dw_returned, BF16 + AOT)
    assert eager[0]["train"][-1][0] < eager[0]["train"][0][0]  # it learns
    for c, e in zip(compiled, eager):
        assert c["compiled"] == [True] * 4 and c["graph_breaks"] == 0, c
        _assert_close(c, e, rtol=1e-6)
    with pytest.raises(AssertionError, match="Mismatched elements"):
        _assert_close(planted[0], eager[0], rtol=1e-6)


REFUSED = {
    "cuda-graphs": (["--enable-cuda-graph", "--hidden-dropout", "0"], 1, "enable-cuda-graph"),
    "te": (["--transformer-impl", "transformer_engine"], 1, "transformer-impl"),
    "fp8": (
        ["--transformer-impl", "transformer_engine", "--fp8-format", "hybrid"],
        1,
        "transformer-impl",
    ),
    "moe": (["--num-experts", "4"], 1, "num-experts"),
    "cp-ring": (["--context-parallel-size", "2"], 2, "cp-comm-type"),  # p2p: the default
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_compile_refuses_what_it_cannot_do(case):
    from pentatron.pretrain.arguments import ArgumentError, parse_args, validate_args

    extra, world, flag = REFUSED[case]
    # the local spec unless the case names TE (Megatron's default, which --compile refuses)
    base = [*TINY_GPT, "--train-iters", "8", "--transformer-impl", "local", *extra]
    # fine without --compile on a GPU machine with transformer-engine
    validate_args(parse_args(base), world, cuda=True, have_te=True)
    with pytest.raises(ArgumentError) as info:
        validate_args(parse_args([*base, "--compile"]), world, cuda=True, have_te=True)
    msg = str(info.value)
    assert msg.startswith(f"--{flag}=") and "with --compile:" in msg, msg
    assert "fix:" in msg and "\n" not in msg, msg


def test_compile_backend_needs_compile():
    from pentatron.pretrain.arguments import ArgumentError, parse_args, validate_args

    argv = [*TINY_GPT, "--train-iters", "8", "--compile-backend", "eager"]
    with pytest.raises(ArgumentError, match=r"^--compile-backend=eager: has no effect.*fix:"):
        validate_args(parse_args(argv), 1)


ACCEPTED = {
    "default-backend": ([], 1),
    "aot_eager": (["--compile-backend", "aot_eager"], 1),
    "cp-all_gather": (["--context-parallel-size", "2", "--cp-comm-type", "all_gather"], 2),
    "cp-a2a": (["--context-parallel-size", "2", "--cp-comm-type", "a2a"], 2),
    "fsdp2": (["--tensor-model-parallel-size", "2", "--use-torch-fsdp2"], 4),
    "selective-recompute": (["--recompute-granularity", "selective"], 1),
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_compile_accepts_what_composes(case):
    from pentatron.pretrain.arguments import parse_args, validate_args

    extra, world = ACCEPTED[case]
    args = validate_args(parse_args([*TINY_GPT, "--train-iters", "8", "--compile", *extra]), world)
    assert args.compile_backend == ("aot_eager" if case == "aot_eager" else "inductor")


def test_compiling_keeps_the_module_its_parameters_and_state_dict_keys():
    from pentatron.models import GPTModel, TransformerConfig, get_gpt_layer_local_spec
    from pentatron.pretrain.training.compile import compile_layers, is_compiled

    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2)
    model = GPTModel(config, get_gpt_layer_local_spec(), 64, 8, make_vocab_size_divisible_by=8)
    layers, params = list(model.decoder.layers), dict(model.named_parameters())
    keys = list(model.state_dict())
    assert compile_layers(model, "eager") == 2
    assert all(is_compiled(layer) for layer in model.decoder.layers)
    assert not is_compiled(model) and not is_compiled(model.embedding)
    assert list(model.decoder.layers) == layers and list(model.state_dict()) == keys
    assert all(p is params[name] for name, p in model.named_parameters())
    with pytest.raises(ValueError, match="backend='cudagraphs'"):
        compile_layers(model, "cudagraphs")


def test_a_compiled_run_with_full_recomputation_ends_clean():
    """The app's own end after `--compile` with full recomputation, launched as a user
    does (torchrun, one rank): exit 0, no gloo thread left (the app warns when one is: the
    recomputed layers outlived one gc pass, and their groups with them), and no
    `Exception ignored` from Dynamo's clean-up of its compiled functions (one per function
    at every exit with dropout on, when parallel-state deleted their globals first)."""
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    recompute += ["--recompute-num-layers", "1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += ["1", "-m", "pentatron.pretrain", *TINY_GPT, "--train-iters", "3"]
    # Megatron's dropout (TINY_GPT pins 0): the compiled functions that use the RNG are
    # the ones freed only at the interpreter's exit, where the KeyErrors were printed.
    cmd += ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    cmd += ["--transformer-impl", "local", *AOT, *recompute]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "done: 3 iterations (train-iters)" in out, out[-3000:]
    assert "pentatron-pretrain: warning" not in out, out[-3000:]
    assert "Exception ignored" not in out, out[-3000:]
