"""Played in a process of its own for test_device_dry_run.py: ranks of a layout on the fake GPU.

    run(LAYOUT, RANKS, PLANT, SAVE_DIR, EXTRA)        # in a fresh process (the test's way)
    python _dry_run.py LAYOUT RANKS PLANT SAVE_DIR    # by hand: one JSON line on stdout

For each rank in RANKS (comma-separated), in turn: a fake world of the layout's size
(`meta:fake` compute groups, `cpu:fake` host group), then the app's real `pretrain()` under
`FakeDevice`: initialize, get_model (DDP chunks, distributed optimizer), the pipeline
schedule's forward and backward of every micro-batch, the step's reductions, the optimizer
step, a checkpoint save. PLANT re-introduces one defect the GPU run found (see PLANTS); the
test expects each to fail here, so the process must not outlive the call. The result holds,
per rank, the host reads per training step and the GEMMs' operand dtypes, or the error that
stopped the rank.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
from _app import TP2_PP2, TP2_PP2_VPP2_SP_ZERO1

# A tiny GPT in bf16: every GEMM of the model must take bf16 operands on the fake GPU.
MODEL = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--swiglu",
    "--ffn-hidden-size",
    "128",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--micro-batch-size",
    "2",
    "--mock-data",
    "--vocab-size",
    "256",
    "--make-vocab-size-divisible-by",
    "32",
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "1",
    "--eval-iters",
    "0",
    "--log-interval",
    "1",
    "--no-progress",
    "--bf16",
    "--disable-bias-linear",
    "--normalization",
    "RMSNorm",
    "--position-embedding-type",
    "rope",
]
LAYOUTS = {
    # world 8: tp2 x pp2 (2 virtual stages) x dp2, SP, ZeRO-1 with overlapped grad reduce
    # and param gather (the bucket hooks and the async all-gathers run too)
    "tp2-pp2-dp2": (8, [*TP2_PP2_VPP2_SP_ZERO1, "--global-batch-size", "8"]),
    # world 8: the same under ZBV (two chunks per rank in a V: receive buffers, the second
    # channel's group, the loss moved from pipeline rank 0 to the last, the W store)
    "zbv-tp2-pp2-dp2": (
        8,
        [
            *TP2_PP2,
            "--sequence-parallel",
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
            "--pipeline-schedule",
            "zbv",
            "--untie-embeddings-and-output-weights",
            "--global-batch-size",
            "8",
        ],
    ),
    # world 8: Megatron's custom layout at tp2 x pp2 x dp2, SP, ZeRO-1 with both overlaps:
    # rank 0's second chunk is empty (no layer, no parameter), pipeline rank 1's second
    # holds only the final norm and the loss
    "layout-tp2-pp2-dp2": (
        8,
        [
            *TP2_PP2,
            *("--pipeline-model-parallel-layout", "Et|ttt||L", "--sequence-parallel"),
            *("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"),
            *("--global-batch-size", "8"),
        ],
    ),
    # world 8: fp16 with dynamic loss scaling at tp2 x pp2 x dp2 with SP and the distributed
    # optimizer (the scaled loss, the unscale with its inf check agreed over the grid)
    "fp16-tp2-pp2-dp2": (
        8,
        [
            *TP2_PP2,
            "--sequence-parallel",
            "--use-distributed-optimizer",
            "--fp16",
            "--global-batch-size",
            "8",
        ],
    ),
    # world 4: MoE, 4 experts over ep2 (all-to-all dispatcher, grouped GEMM), tp2 with SP,
    # aux loss and expert bias (the per-step expert-bias all-reduce)
    "moe-tp2-ep2": (
        4,
        [
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--expert-model-parallel-size",
            "2",
            "--num-experts",
            "4",
            "--moe-router-topk",
            "2",
            "--moe-grouped-gemm",
            "--moe-aux-loss-coeff",
            "0.01",
            "--moe-token-dispatcher-type",
            "alltoall",
            "--use-distributed-optimizer",
            "--global-batch-size",
            "8",
        ],
    ),
    # world 4: context parallelism cp2 (the ring: K/V and dK/dV sent around it; another
    # --cp-comm-type as an extra flag) x tp2 with SP and ZeRO-1
    "cp2-tp2": (
        4,
        [
            *("--context-parallel-size", "2", "--cp-comm-type", "p2p"),
            *("--tensor-model-parallel-size", "2", "--sequence-parallel"),
            *("--use-distributed-optimizer", "--global-batch-size", "8"),
        ],
    ),
    # world 4: hierarchical cp4 (a2a+p2p, 2 x 2: the all-to-all over cp pairs, the ring
    # over the pairs on the grid's hcp groups) with ZeRO-1
    "hcp4": (
        4,
        [
            *("--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"),
            *("--hierarchical-context-parallel-sizes", "2", "2"),
            *("--use-distributed-optimizer", "--global-batch-size", "8"),
        ],
    ),
    # world 8: multi-latent attention with q latent, latent norms and YaRN at tp2 x pp2
    # (2 virtual stages) x dp2 with SP and ZeRO-1, and one MTP depth (the last stage's
    # embedding copy, its all-reduce over the embedding group, the rolled inputs)
    "mla-tp2-pp2-dp2": (
        8,
        [
            *TP2_PP2_VPP2_SP_ZERO1,
            "--global-batch-size",
            "8",
            "--multi-latent-attention",
            "--q-lora-rank",
            "32",
            "--kv-lora-rank",
            "16",
            "--qk-head-dim",
            "16",
            "--qk-pos-emb-head-dim",
            "8",
            "--v-head-dim",
            "16",
            "--qk-layernorm",
            "--rotary-scaling-factor",
            "4",
            "--mscale-all-dim",
            "1.0",
            "--mtp-num-layers",
            "1",
        ],
    ),
}


def _old_get_batch(data_iterator, model, grid, micro_batch_size, seq_length):
    """The batch as the app built it before: on the host, never moved."""
    from pentatron.models.context_parallel import get_batch_on_this_cp_rank
    from pentatron.parallel_state import comm
    from pentatron.pretrain import gpt_step

    chunk = gpt_step._unwrap(model)
    if not (chunk.pre_process or chunk.post_process):
        return None
    if grid.rank("tp") == 0:
        batch = next(data_iterator)
        packed = torch.stack([batch[k].to(torch.int64) for k in gpt_step.BATCH_KEYS])
    else:
        packed = torch.empty((4, micro_batch_size, seq_length), dtype=torch.int64)
    if grid.size("tp") > 1:
        comm.broadcast(packed, src=grid.ranks("tp")[0], group=grid.group("tp"))
    out = dict(zip(gpt_step.BATCH_KEYS, packed.unbind(0)))
    out["loss_mask"] = out["loss_mask"].float()
    return get_batch_on_this_cp_rank(out, grid.size("cp"), grid.rank("cp"))


def _old_nonfinite_flags(reduced, chunks, grid, check_grads):
    """The step's verdict as it was: host booleans all-reduced over the world's compute
    group (NCCL on a GPU)."""
    from pentatron.parallel_state import comm

    loss_ok = all(bool(torch.isfinite(r["lm loss"]).all()) for r in reduced)
    t = torch.tensor([float(not loss_ok), 0.0], dtype=torch.float64)
    comm.all_reduce(t, op=comm.ReduceOp.MAX)
    return t


def _plant(name: str) -> None:
    from pentatron.pretrain import gpt_step
    from pentatron.pretrain.training import step
    from pentatron.tp_layers.layers import wgrad

    if name == "batch-on-host":
        gpt_step.get_batch = _old_get_batch
    elif name == "host-tensor-collective":
        step._nonfinite_flags = _old_nonfinite_flags
    elif name == "fp32-wgrad":  # the weight-gradient GEMM with operands widened to fp32
        wgrad.wgrad_kernel = lambda device, dtype: "addmm_fp32"
    elif name == "sync-per-microbatch":  # read each micro-batch's loss on the host
        from pentatron.pipeline.schedules import common

        original = common._apply_loss

        def apply_loss(state, output, loss_func):
            loss = original(state, output, loss_func)
            float(loss.detach())
            return loss

        common._apply_loss = apply_loss
    elif name == "moe-param-on-host":  # the router weight made where torch defaults to
        from pentatron.models.moe import router

        router.current_device = lambda: torch.device("cpu")
    elif name == "fp16-inv-scale-on-host":  # the unscale's 1/scale as a host tensor
        from pentatron.optim.optimizer import clip_grads

        unscale = clip_grads.torch._amp_foreach_non_finite_check_and_unscale_

        def host_inv(grads, found, inv):  # the fake device has no value to copy: 1.0
            unscale(grads, found, torch.ones(1, dtype=torch.float32))

        clip_grads.torch = _TorchWith(_amp_foreach_non_finite_check_and_unscale_=host_inv)
    elif name != "none":
        raise ValueError(f"unknown plant {name!r}")


class _TorchWith:
    """`torch` with some attributes replaced: a plant reaches one call site only."""

    def __init__(self, **replaced) -> None:
        self._replaced = replaced

    def __getattr__(self, name):
        return self._replaced.get(name, getattr(torch, name))


class _StepReads:
    """Counts the fake device's host reads per training step (train_step wrapped)."""

    def __init__(self, device) -> None:
        self.device, self.per_step = device, []

    def wrap(self, train_step):
        def counted(*args, **kwargs):
            before = len(self.device.reads)
            out = train_step(*args, **kwargs)
            self.per_step.append(len(self.device.reads) - before)
            return out

        return counted


class _CpKernels:
    """Counts context parallelism's fused block kernels by name ("flash_cuda fwd", ...)."""

    def __init__(self) -> None:
        from pentatron.models.context_parallel import softmax_merge

        self.module, self.calls = softmax_merge, {}
        self.real = (softmax_merge.fused_forward, softmax_merge.fused_backward)

    def __enter__(self) -> _CpKernels:
        fwd, bwd = self.real

        def counted(fn, what):
            def call(kernel, *args, **kwargs):
                key = f"{kernel} {what}"
                self.calls[key] = self.calls.get(key, 0) + 1
                return fn(kernel, *args, **kwargs)

            return call

        self.module.fused_forward, self.module.fused_backward = (
            counted(fwd, "fwd"),
            counted(bwd, "bwd"),
        )
        return self

    def __exit__(self, *exc) -> None:
        self.module.fused_forward, self.module.fused_backward = self.real


def play(layout: str, rank: int, save_dir: str, extra: list[str]) -> dict:
    import torch.distributed.checkpoint as dcp

    from pentatron.parallel_state.testing.fake_device import FakeDevice, fake_world
    from pentatron.pretrain.arguments import parse_args, validate_args
    from pentatron.pretrain.checkpointing import save as save_module
    from pentatron.pretrain.pretrain_gpt import pretrain
    from pentatron.pretrain.training import loop

    world, flags = LAYOUTS[layout]
    dtype = torch.float16 if "--fp16" in flags else torch.bfloat16
    model = [f for f in MODEL if f != "--bf16"] if dtype == torch.float16 else MODEL
    argv = [*model, *flags, "--train-iters", "2", "--save", save_dir, "--save-interval", "2"]
    argv += extra
    # DCP's cross-rank planning exchanges pickled objects, which a fake group cannot carry:
    # each fake rank plans its own files (no_dist). Writer and state dict are the real ones.
    save_module.dcp = _NoDistDCP(dcp)
    with fake_world(rank, world), FakeDevice(compute_dtype=dtype) as device, _CpKernels() as cp:
        args = validate_args(parse_args(argv), world)
        reads, original = _StepReads(device), loop.train_step
        loop.train_step = reads.wrap(original)
        try:
            state = pretrain(args)
        finally:
            loop.train_step = original
    return {
        "iterations": state.iteration,
        "reads_per_step": reads.per_step,
        "gemm_dtypes": sorted({str(d) for g in device.gemms for d in g.dtypes}),
        "gemms": len(device.gemms),
        "cp_kernels": cp.calls,
    }


class _NoDistDCP:
    def __init__(self, dcp) -> None:
        self._dcp = dcp

    def __getattr__(self, name):
        return getattr(self._dcp, name)

    def save(self, *args, **kwargs):
        kwargs.pop("process_group", None)
        return self._dcp.save(*args, no_dist=True, **kwargs)


def run(layout: str, ranks: str, plant: str, save_dir: str, extra: list[str]) -> dict:
    """Each of RANKS played in turn with PLANT planted; by rank, what `play` returned or
    the error it raised (the test reads it)."""
    _plant(plant)
    out: dict[int, dict] = {}
    for rank in (int(r) for r in ranks.split(",")):
        try:
            out[rank] = play(layout, rank, f"{save_dir}/rank{rank}", extra)
        except BaseException as exc:
            out[rank] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    return out


def main() -> int:
    layout, ranks, plant, save_dir = sys.argv[1:5]
    print(json.dumps(run(layout, ranks, plant, save_dir, sys.argv[5:])))
    return 0


if __name__ == "__main__":
    code = main()
    # The JSON line is out: skip the interpreter's teardown (about 0.9 s with torch loaded).
    # Nothing of the fake world outlives the process.
    sys.stdout.flush()
    os._exit(code)
