"""What each device check runs and how its outcome reads (run_all.py runs them).

A check is a function of a `Ctx` (its deadline, the combined log, the machine, a temp
folder) returning an `Outcome` (status, one-line summary, figures for results.json). It
runs one or more steps: app runs (`Ctx.app`, `python3 -m pentatron.pretrain ...` whose
metrics JSONL is read back) or scripts of this folder (`Ctx.script`, which report through
a `RESULT {json}` line). A step that fails, times out or prints no RESULT makes the check
FAIL / TIMEOUT with the step's last error line; whatever it measured before stays in the
summary. Only the standard library: nothing here imports torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _app_runs as A
import _paths
from _proc import CombinedLog, StepResult, python, run_step, step_env

HERE = Path(__file__).resolve().parent


@dataclass
class Outcome:
    status: str  # OK, FAIL, TIMEOUT, SKIP, N/A (DRY under --dry-run)
    summary: str
    figures: dict = field(default_factory=dict)


@dataclass
class Check:
    name: str
    plan_s: float  # expected seconds on one H200
    cap_s: float  # its timeout there
    smoke_cap_s: float  # its timeout in --smoke (CPU, 2 busy cores)
    fn: Callable[[Ctx], Outcome]
    needs_cuda: bool = False


class Ctx:
    """What a check function gets: its deadline, the log, the machine, a temp folder."""

    def __init__(self, opts, log: CombinedLog | None, tmp: Path, machine: dict, deadline: float):
        self.smoke, self.log, self.tmp, self.machine = opts.smoke, log, tmp, machine
        self.dry = getattr(opts, "dry_run", False)
        self.deadline = deadline
        self.steps: list[StepResult] = []
        self.device = "cpu" if opts.smoke else "cuda"
        self.peak = machine.get("peak_bf16_tflops")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, label: str, argv: list[str]) -> StepResult:
        if self.dry:  # --dry-run: the command line only
            print(f"  {label}: {' '.join(argv)}", flush=True)
            res = StepResult(label, argv, rc=0)
        elif self.left() < 3:
            res = StepResult(label, argv, tail=["not started: no time left in this check"])
            res.timed_out = True
        else:
            assert self.log is not None
            res = run_step(label, argv, self.log, self.left(), step_env())
        self.steps.append(res)
        return res

    def script(self, label: str, name: str, *args: str) -> StepResult:
        return self.run(label, [python(), str(HERE / name), *args])

    def app(self, label: str, flags: list[str], warmup: int) -> tuple[StepResult, dict]:
        """One app run; its metrics summarized (medians after `warmup` iterations)."""
        jsonl = self.tmp / f"{label}.jsonl"
        argv = [python(), "-m", "pentatron.pretrain", *flags, "--log-jsonl", str(jsonl)]
        res = self.run(label, argv)
        return res, A.summarize(A.read_train_records(jsonl), warmup, self.peak)


# ---- outcomes from steps --------------------------------------------------------------


def step_failure(res: StepResult) -> Outcome | None:
    """TIMEOUT / FAIL for a step that did not finish cleanly, else None."""
    if res.timed_out:
        return Outcome("TIMEOUT", f"{res.label}: timed out after {res.seconds:.0f} s")
    if res.rc != 0:
        return Outcome("FAIL", f"{res.label}: exit {res.rc}: {res.error_line()[:160]}")
    return None


def script_outcome(res: StepResult, describe: Callable[[dict], str]) -> Outcome:
    """A script step's outcome: its RESULT described, and the failure if any."""
    r = res.result()
    try:
        text = describe(r) if r else ""
    except (KeyError, TypeError, ValueError, IndexError) as e:  # a partial RESULT
        text = f"(RESULT unreadable: {type(e).__name__} {e})"
    bad = step_failure(res)
    if bad is not None:
        bad.summary = "; ".join(x for x in (text, bad.summary) if x)
        bad.figures = r
        return bad
    if not r:
        return Outcome("FAIL", f"{res.label}: exit 0 but no RESULT line", r)
    if r.get("status") in ("N/A", "SKIP"):
        return Outcome(r["status"], r.get("note", ""), r)
    return Outcome("OK", text, r)


def app_outcome(res: StepResult, m: dict) -> Outcome:
    """OK when the run finished, logged its iterations and the loss went down."""
    bad = step_failure(res)
    if bad is not None:
        if m["iterations"]:
            bad.summary += f" ({m['iterations']} it logged: {A.describe(m)})"
        bad.figures = m
        return bad
    if not m["iterations"]:
        return Outcome("FAIL", f"{res.label}: no metrics logged", m)
    return Outcome("OK" if m["loss_down"] else "FAIL", A.describe(m), m)


def combine(outcomes: list[Outcome], figures: dict) -> Outcome:
    """Worst status of the parts, summaries joined."""
    order = ["FAIL", "TIMEOUT", "N/A", "SKIP", "OK"]
    status = min((o.status for o in outcomes), key=order.index)
    return Outcome(status, "; ".join(o.summary for o in outcomes if o.summary), figures)


def _tflops(label: str, r: dict, peak: float | None) -> str:
    mfu = f", MFU {r['tflops'] / peak:.1%}" if peak else ""
    ms = f" ({r['step_s'] * 1e3:.0f} ms/step)" if r.get("step_s") else ""
    return f"{label} {r['tokens_per_s']:,.0f} tok/s{ms}, {A.num(r['tflops'])} TFLOP/s{mfu}"


def _add_mfu(r: dict, peak: float | None) -> None:
    if peak and isinstance(r, dict) and r.get("tflops") is not None:
        r["mfu"] = r["tflops"] / peak


# ---- the checks -----------------------------------------------------------------------


def _issue_flags(ctx: Ctx, warmup: int) -> tuple[list[str], int]:
    """The `app` run: ISSUE shape, 12 iterations (smoke: TINY, 6)."""
    if ctx.smoke:
        return A.run_flags(A.TINY, "cpu", 6, lr=1e-3), 2
    return A.run_flags(A.ISSUE, "cuda", 12), warmup


def check_app(ctx: Ctx) -> Outcome:
    flags, warmup = _issue_flags(ctx, 3)
    return app_outcome(*ctx.app("app", flags, warmup))


def check_app_compile(ctx: Ctx) -> Outcome:
    flags, warmup = _issue_flags(ctx, 4)
    res, m = ctx.app("app-compile", [*flags, "--compile"], warmup)
    text = "".join(res.tail)
    if res.rc == 2 and "--compile" in text and "unrecognized arguments" in text:
        return Outcome("N/A", "the app has no --compile flag yet")
    return app_outcome(res, m)


def check_plain(ctx: Ctx) -> Outcome:
    args = ["--device", ctx.device, "--compile", "layers"]
    args += ["--tiny", "--steps", "3", "--warmup", "1"] if ctx.smoke else ["--steps", "10"]
    res = ctx.script("plain", "plain_loop.py", *args)
    for mode in ("eager", "compiled"):
        _add_mfu(res.result().get(mode), ctx.peak)

    def describe(r: dict) -> str:
        parts = [_tflops(m, r[m], ctx.peak) for m in ("eager", "compiled") if m in r]
        return "; ".join(parts) + (" (compiled: per layer)" if "compiled" in r else "")

    return script_outcome(res, describe)


def check_hf(ctx: Ctx) -> Outcome:
    tiny = ["--tiny", "--steps", "3", "--warmup", "1"] if ctx.smoke else []
    res = ctx.script("hf", "hf_llama.py", "--device", ctx.device, *tiny)
    _add_mfu(res.result(), ctx.peak)
    return script_outcome(res, lambda r: _tflops("LlamaForCausalLM", r, ctx.peak))


def check_cuda_graphs(ctx: Ctx) -> Outcome:
    def ms(v: Any) -> str:
        return "n/a" if v is None else f"{v:.1f} ms"

    def describe(r: dict) -> str:
        return (f"max rel loss diff {r['max_rel_diff']:.1e} (tol {r['tolerance']:g}); step "
                f"eager {ms(r['step_eager_ms'])}, graphed {ms(r['step_graphed_ms'])}")  # fmt: skip

    return script_outcome(ctx.script("cuda-graphs", "cuda_graphs.py"), describe)


def check_sdpa(ctx: Ctx) -> Outcome:
    def describe(r: dict) -> str:
        return "; ".join(
            f"{dt} {'grouped' if v['grouped_kv'] else 'repeated'} k/v: {v['backend']}"
            + ("" if v["ok"] else " FAIL")
            for dt, v in r.items()
            if isinstance(v, dict)
        )

    return script_outcome(ctx.script("sdpa", "sdpa_gqa.py"), describe)


def check_moe(ctx: Ctx) -> Outcome:
    tiny = ["--tiny", "--reps", "3"] if ctx.smoke else []
    res = ctx.script("moe-grouped-gemm", "moe_grouped.py", "--device", ctx.device, *tiny)

    def describe(r: dict) -> str:
        worst = max(r["rel_errors"].values())
        return (f"grouped_mm {'on' if r['grouped_mm_used'] else 'OFF'}, max rel err "
                f"{worst:.1e} (tol {r['tolerance']:g}), grouped/loop time {r['ratio']:.2f}")  # fmt: skip

    kernel = script_outcome(res, describe)
    shape = A.TINY if ctx.smoke else A.SMALL
    flags = A.run_flags(shape, ctx.device, 6 if ctx.smoke else 10, lr=1e-3)
    flags += ["--num-experts", "8", "--moe-router-topk", "2", "--moe-grouped-gemm"]
    app_res, m = ctx.app("moe-app", flags, 2)
    app = app_outcome(app_res, m)
    app.summary = "app " + app.summary
    return combine([kernel, app], {"grouped_gemm": res.result(), "app": m})


def check_dp_overlap(ctx: Ctx) -> Outcome:
    shape = A.TINY if ctx.smoke else A.SMALL
    iters = 6 if ctx.smoke else 10
    bucket = "20000" if ctx.smoke else "2000000"  # elements: several buckets either way
    zero1 = A.run_flags(shape, ctx.device, iters, lr=1e-3)
    zero1 += ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", bucket]
    fsdp2 = [*A.run_flags(shape, ctx.device, iters, lr=1e-3, dist_opt=False), "--use-torch-fsdp2"]
    return _app_runs(ctx, [("zero1-overlap", zero1), ("fsdp2", fsdp2)])


def _app_runs(ctx: Ctx, runs: list[tuple[str, list[str]]], checks=None) -> Outcome:
    """Several app runs, each OK when it finishes and its loss goes down; `checks` maps a
    label to a function that may amend that run's outcome afterwards."""
    outs, figs = [], {}
    for label, flags in runs:
        res, m = ctx.app(label, flags, 2)
        o = app_outcome(res, m)
        if o.status == "OK":
            o.summary = f"{label}: {A.loss_trend(m)} ({m['iterations']} it)"
        elif not o.summary.startswith(label):
            o.summary = f"{label}: {o.summary}"
        if checks and label in checks and not ctx.dry:
            checks[label](o)
        outs.append(o)
        figs[label] = m
    return combine(outs, figs)


QUICKSTART_DROP = ("num-layers-per-virtual-pipeline-stage", "sequence-parallel")
GPU_CONFIG_DROP = ("sequence-parallel", "save", "load", "save-interval", "tensorboard-dir",
                   "async-save")  # fmt: skip
ONE_GPU_SCALE = [
    "--num-layers", "4", "--hidden-size", "512", "--ffn-hidden-size", "1792",
    "--num-attention-heads", "8", "--num-query-groups", "2", "--seq-length", "1024",
    "--max-position-embeddings", "1024", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "12", "--vocab-size", "8191",
]  # fmt: skip
SMOKE_SCALE = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
    "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "64",
    "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--train-iters", "6", "--vocab-size", "511",
]  # fmt: skip


def check_examples(ctx: Ctx) -> Outcome:
    """quickstart-cpu.yaml on one device (embedded corpus, checkpoint saved), and the two GPU
    example configs scaled down (mock data, no checkpoint; everything else as configured:
    recompute, overlap flags, MoE router and alltoall dispatcher with grouped GEMMs)."""
    configs = _paths.REPO / "examples" / "configs"
    one = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
           "--device", ctx.device, "--eval-iters", "0", "--log-interval", "1", "--no-progress"]  # fmt: skip
    qs_dir = ctx.tmp / "quickstart"
    qs_cfg = A.derive_config(configs / "quickstart-cpu.yaml", QUICKSTART_DROP,
                             ctx.tmp / "quickstart.yaml")  # fmt: skip
    qs = ["--config", str(qs_cfg), *one, "--save", str(qs_dir), "--load", str(qs_dir),
          "--tensorboard-dir", str(qs_dir / "tb")]  # fmt: skip
    qs += (["--train-iters", "8", "--global-batch-size", "8", "--lr-warmup-iters", "2"]
           if ctx.smoke else ["--train-iters", "30"])  # fmt: skip
    scale = SMOKE_SCALE if ctx.smoke else ONE_GPU_SCALE
    scale = [*scale, "--mock-data", "--tokenizer-type", "NullTokenizer", "--lr-warmup-iters", "2"]
    runs = [("quickstart", qs)]
    moe = ["--num-experts", "4", "--expert-model-parallel-size", "1",
           "--expert-tensor-parallel-size", "1"]  # fmt: skip
    for name, extra in (("llama3-8b-like", []), ("mixtral-8x7b-like", moe)):
        cfg = A.derive_config(configs / f"{name}.yaml", GPU_CONFIG_DROP, ctx.tmp / f"{name}.yaml")
        runs.append((name, ["--config", str(cfg), *scale, *one, *extra]))

    def checkpoint_saved(o: Outcome) -> None:
        if o.status != "OK":
            return
        saved = (qs_dir / "latest_checkpointed_iteration.txt").exists()
        o.summary += ", checkpoint saved" if saved else ", NO checkpoint saved"
        o.status = "OK" if saved else "FAIL"

    return _app_runs(ctx, runs, {"quickstart": checkpoint_saved})


def check_wgrad(ctx: Ctx) -> Outcome:
    tiny = ["--tiny"] if ctx.smoke else []
    res = ctx.script("wgrad", "wgrad.py", "--device", ctx.device, *tiny)

    def describe(r: dict) -> str:
        kernels = ", ".join(k[:48] for k in r["kernels"][:3]) or "-"
        return (f"path {r['path']}, rel err {r['rel_error_1_call']:.1e} / "
                f"{r['rel_error_2_calls']:.1e} (1 / 2 calls, tol {r['tolerance']:g}), "
                f"{A.num(r['tflops'])} TFLOP/s, fp32 SIMT GEMMs {len(r['fp32_simt_gemms'])}, "
                f"kernels: {kernels}")  # fmt: skip

    return script_outcome(res, describe)


def check_profile(ctx: Ctx) -> Outcome:
    shape = A.TINY if ctx.smoke else A.ISSUE
    flags = A.run_flags(shape, ctx.device, 4, lr=1e-3 if ctx.smoke else 3e-4)
    res = ctx.script("profile", "profile_app.py", "--active", "2", "--", *flags)

    def describe(r: dict) -> str:
        top = r["top"][0] if r["top"] else {"name": "-", "share": 0.0}
        return (f"fp32 SIMT GEMM {r['fp32_simt_gemm_share']:.1%}, NCCL {r['nccl_share']:.1%} "
                f"of {r['source']}; top {top['name'][:60]} ({top['share']:.0%})")  # fmt: skip

    return script_outcome(res, describe)


def check_variants(ctx: Ctx) -> Outcome:
    tiny = ["--tiny"] if ctx.smoke else []
    res = ctx.script("attention-variants", "attention_variants.py", "--device", ctx.device, *tiny)

    def describe(r: dict) -> str:
        parts = [f"causal {r['causal']['ms']:.2f} ms"]
        for name in ("sinks", "window", "sinks+window"):
            v = r[name]
            kernel = f" {v['backend']}" if "backend" in v else ""
            parts.append(f"{name} {v['vs_causal']:.2f}x{kernel}" + ("" if v["ok"] else " FAIL"))
        return f"{r['dtype']} fwd+bwd: " + ", ".join(parts)

    return script_outcome(res, describe)


def check_cp_blocks(ctx: Ctx) -> Outcome:
    tiny = ["--tiny"] if ctx.smoke else []
    res = ctx.script("cp-blocks", "cp_blocks.py", "--device", ctx.device, *tiny)

    def describe(r: dict) -> str:
        fused, maths = r["fused"], r["maths"]
        kernel = f" ({fused['backend']})" if "backend" in fused else ""
        peak = ""
        if "peak_mib" in fused:
            peak = f", peak {fused['peak_mib']:.0f} / {maths['peak_mib']:.0f} MiB"
        worst = max(fused["rel_errors"].values())
        return (f"{r['dtype']} 3 pairs fwd+bwd: fused{kernel} {fused['ms']:.1f} ms / maths "
                f"{maths['ms']:.1f} ms = {r['fused_over_maths']:.2f}{peak}; max rel error "
                f"{worst:.1e}" + ("" if fused["ok"] and maths["ok"] else " FAIL"))  # fmt: skip

    return script_outcome(res, describe)


CHECKS = [
    Check("app", 35, 70, 150, check_app),
    Check("app-compile", 65, 120, 300, check_app_compile),
    Check("plain", 50, 100, 240, check_plain),
    Check("hf", 20, 50, 150, check_hf),
    Check("cuda-graphs", 20, 45, 0, check_cuda_graphs, needs_cuda=True),
    Check("sdpa", 10, 30, 0, check_sdpa, needs_cuda=True),
    Check("moe", 25, 50, 200, check_moe),
    Check("dp-overlap", 20, 50, 200, check_dp_overlap),
    Check("examples", 45, 90, 400, check_examples),
    Check("wgrad", 5, 25, 60, check_wgrad),
    Check("cp-blocks", 5, 25, 60, check_cp_blocks),
    Check("profile", 20, 60, 150, check_profile),
    Check("variants", 10, 40, 60, check_variants),
]
