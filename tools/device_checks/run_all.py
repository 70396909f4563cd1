"""The project's one GPU device-check entry point: every check, in priority order, in one
budget, one table at the end.

    python3 tools/device_checks/run_all.py --out DIR [--budget-s 330] [--only app,plain,...]
    python3 tools/device_checks/run_all.py --out DIR --smoke     # tiny shapes on CPU

Made for one NVIDIA H200 (checked nowhere else) and a copy of the working tree with
nothing installed: every check is a subprocess (`python3 -m pentatron.pretrain` for app
runs, or a script of this folder) with the repository's `packages/*/src` and
`apps/*/src` on PYTHONPATH, a world of one (RANK/WORLD_SIZE/MASTER_ADDR and a free
MASTER_PORT each; no torchrun) and its own timeout: min(its cap, what is left of
`--budget-s`). A check that fails or times out never stops the ones after it; one that
would start with less than 15 s of budget left is skipped. The total stays under
`--budget-s` plus the kill grace of one step (330 s: under 6 minutes).

Checks (priority order; planned seconds on one H200 / cap, printed at the start):
  app          the training app at issue #20's shape (~0.89B Llama-shaped GPT: 16 layers,
               hidden 2048, GQA 16/8, SwiGLU 5632, vocab 32000, b4 x s2048, global batch
               16 = 4 micro-batches, bf16, distributed optimizer), 12 iterations; tokens/s,
               ms/iteration, model TFLOP/s and MFU (989 TFLOP/s dense bf16 peak): medians
               of iterations 4-12 of the app's metrics JSONL; the loss must go down
  app-compile  the same with --compile (N/A while the app rejects the flag), iterations 5-12
  plain        the same GPTModel in a plain loop (benchmarks/gpu_mfu.py): bf16 params,
               fused AdamW, one micro-batch per step; eager, then torch.compile per layer
  hf           transformers' LlamaForCausalLM of the same shape (sdpa, bf16, fused AdamW)
  cuda-graphs  cuda_graphs.py: eager vs --enable-cuda-graph losses (1e-3) and step time
  sdpa         sdpa_gqa.py: the SDPA kernel of grouped attention in bf16/fp16/fp32 (not math)
  moe          moe_grouped.py (GroupedMLP's torch._grouped_mm vs the loop: match, time
               ratio) and a small MoE app run (8 experts, top-2, grouped GEMM): loss down
  dp-overlap   small app runs with ZeRO-1 + overlapped grad reduce / param gather (several
               buckets) and with FSDP2: both finish, loss down
  examples     examples/configs/quickstart-cpu.yaml on the GPU (1 process, 30 iterations,
               embedded corpus, checkpoint saved), llama3-8b-like.yaml and
               mixtral-8x7b-like.yaml scaled to one GPU: loss down
  wgrad        wgrad.py: accumulate_weight_grad (fp64 reference, 2 calls, no fp32 SIMT GEMM)
  cp-blocks    cp_blocks.py: context parallelism's three K/V pairs of one rank (2L 4096,
               GQA 32/8, d 128, bf16) fused (flash with its lse) vs the unfused maths:
               accuracy against fp32, kernel family, time ratio, peak memory
  profile      profile_app.py: top 15 kernels of the app at the `app` shape, shares of fp32
               SIMT GEMMs and NCCL
  variants     attention_variants.py: gpt-oss's attention (learnable sinks, a 128-key
               window, both) at gpt-oss-20b's heads, s 4096, bf16: fp32 reference at s 512,
               SDPA kernel (not math), fwd+bwd ms against plain causal SDPA
The table ends with app / plain tokens/s (goal >= 0.95) and app-compile MFU (goal >= 50%).

Writes three files to DIR: checks.log (every step's full output, one section each),
results.json (after every check: status, seconds, figures, per-iteration losses) and
summary.md (the table). `--smoke` runs the same pipeline at tiny shapes with --device cpu
(checks that need CUDA are SKIP) so that this script's own logic is proven without a GPU;
apps/pretrain/tests/test_device_checks.py runs a few of its checks in CI.
Exit status: 0 when no check failed or timed out, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from _checks import CHECKS, HERE, Ctx, Outcome
from _kernels import table as kernel_table
from _proc import CombinedLog, StepResult, python, run_step, step_env

H200_PEAK = 989.0
MIN_START_S = 15.0
GOAL_APP_OVER_PLAIN = 0.95
GOAL_COMPILE_MFU = 0.50


# ---- the run --------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for checks.log, results.json, summary.md")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for all checks (default 330; --smoke 1800)")  # fmt: skip
    p.add_argument("--only", default=None, help="comma-separated check names, in any order")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU")
    p.add_argument("--dry-run", action="store_true", help="print every step's command only")
    opts = p.parse_args(argv)
    names = [c.name for c in CHECKS]
    if opts.only:
        wanted = [x.strip() for x in opts.only.split(",") if x.strip()]
        unknown = [x for x in wanted if x not in names]
        if unknown:
            p.error(f"--only: unknown check(s) {', '.join(unknown)}; known: {', '.join(names)}")
        opts.only = set(wanted)
    if opts.budget_s is None:
        opts.budget_s = 1800.0 if opts.smoke else 330.0
    return opts


def say(t0: float, text: str) -> None:
    """A progress line, stamped with the seconds since the start."""
    print(f"[{time.monotonic() - t0:5.0f}s] {text}", flush=True)


def dry_machine(smoke: bool) -> dict:
    """What --dry-run assumes instead of probing: one H200, or the CPU in smoke mode."""
    if smoke:
        return {"dry_run": True, "device": "cpu", "cuda": False, "peak_bf16_tflops": None}
    return {"dry_run": True, "device": "H200 (assumed)", "cuda": True,
            "peak_bf16_tflops": H200_PEAK}  # fmt: skip


def plan_steps(smoke: bool, tmp: Path) -> list[tuple[str, StepResult]]:
    """(check, step) of every step every check would run, without running any (the CI test
    validates the GPU command lines with the app's own argument rules)."""
    opts = argparse.Namespace(smoke=smoke, dry_run=True)
    out = []
    for check in CHECKS:
        if smoke and check.needs_cuda:
            continue
        ctx = Ctx(opts, None, tmp, dry_machine(smoke), float("inf"))
        check.fn(ctx)
        out += [(check.name, s) for s in ctx.steps]
    return out


def probe_machine(log: CombinedLog, smoke: bool) -> dict:
    res = run_step("machine", [python(), str(HERE / "machine.py")], log, 60, step_env())
    machine = res.result()
    if not machine:
        machine = {"probe_failed": res.error_line()[:200]}
    if not smoke and not machine.get("peak_bf16_tflops"):
        machine["peak_bf16_tflops"] = H200_PEAK
        machine["peak_note"] = "not from the probe: H200 dense bf16 assumed"
    return machine


def ratios(results: dict[str, dict]) -> list[dict]:
    """app / plain and friends, from figures measured in this run (None where missing)."""

    def fig(check: str, *keys: str):
        v = results.get(check, {}).get("figures") or {}
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        return v

    app, comp = fig("app", "tokens_per_s"), fig("app-compile", "tokens_per_s")
    eager, compiled = (
        fig("plain", "eager", "tokens_per_s"),
        fig("plain", "compiled", "tokens_per_s"),
    )
    hf = fig("hf", "tokens_per_s")

    def r(a, b):
        return a / b if a and b else None

    rows = [
        ("app / plain tokens/s", r(app, eager), GOAL_APP_OVER_PLAIN, ("app", "plain")),
        ("app-compile / plain tokens/s", r(comp, eager), None, ("app-compile", "plain")),
        ("app-compile / plain-compiled tokens/s", r(comp, compiled), None,
         ("app-compile", "plain")),
        ("app-compile MFU", fig("app-compile", "mfu"), GOAL_COMPILE_MFU, ("app-compile",)),
        ("plain / hf tokens/s", r(eager, hf), None, ("plain", "hf")),
    ]  # fmt: skip
    out = []
    for name, v, goal, sources in rows:
        shaky = [f"{c} {results[c]['status']}" for c in sources
                 if c in results and results[c]["status"] != "OK"]  # fmt: skip
        out.append({
            "name": name, "value": v, "goal": goal,
            "met": None if v is None or goal is None else v >= goal,
            "from_runs_not_ok": shaky,
        })  # fmt: skip
    return out


def render_table(results: dict[str, dict], rows: list[dict]) -> str:
    lines = ["| check | result | s | key figures |", "|---|---|---|---|"]
    for name, r in results.items():
        summary = r["summary"].replace("|", "/")
        lines.append(f"| {name} | {r['status']} | {r['seconds']:.0f} | {summary} |")
    for row in rows:
        v = row["value"]
        if v is None:
            value, verdict = "n/a", "not measured in this run"
        else:
            value = f"{v:.1%}" if "MFU" in row["name"] else f"{v:.2f}"
            verdict = "" if row["goal"] is None else (
                f"goal >= {row['goal']:.0%}" if "MFU" in row["name"] else f"goal >= {row['goal']:.2f}")  # fmt: skip
            if row["met"] is not None:
                verdict += ": met" if row["met"] else ": NOT met"
            if row["from_runs_not_ok"]:
                verdict += f" (from {', '.join(row['from_runs_not_ok'])})"
        lines.append(f"| {row['name']} | {value} | | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    t0 = time.monotonic()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    log = CombinedLog(out / "checks.log")
    tmp = Path(tempfile.mkdtemp(prefix="pentatron-device-checks-"))
    mode = "smoke (CPU, tiny shapes)" if opts.smoke else "gpu"
    say(t0, f"run_all: mode {mode}, budget {opts.budget_s:.0f} s, out {out}")
    machine = dry_machine(opts.smoke) if opts.dry_run else probe_machine(log, opts.smoke)
    say(t0, "machine: " + ", ".join(f"{k}={machine.get(k)}" for k in (
        "device", "torch", "python", "transformers", "peak_bf16_tflops")))  # fmt: skip
    for key in ("probe_failed", "pentatron_import_error"):
        if key in machine:
            say(t0, f"machine: {key}: {machine[key]}")
    no_cuda = not opts.smoke and machine.get("cuda") is False
    if no_cuda:
        say(t0, "no CUDA device here: every check is SKIP; use --smoke on a CPU")
    checks = [c for c in CHECKS if not opts.only or c.name in opts.only]
    caps = {c.name: c.smoke_cap_s if opts.smoke else c.cap_s for c in checks}
    say(t0, "plan (s on one H200, timeout in brackets): " + ", ".join(
        f"{c.name} {c.plan_s:.0f} ({caps[c.name]:.0f})" for c in checks)
        + f"; planned total {sum(c.plan_s for c in checks):.0f} s")  # fmt: skip
    report = {
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": "smoke" if opts.smoke else "gpu",
        "argv": sys.argv[1:] if argv is None else argv,
        "budget_s": opts.budget_s,
        "machine": machine,
        "plan": [{"name": c.name, "plan_s": c.plan_s, "cap_s": caps[c.name]} for c in checks],
        "checks": {},
    }
    results: dict[str, dict] = report["checks"]
    for check in checks:
        left = opts.budget_s - (time.monotonic() - t0)
        start = time.monotonic()
        ctx = Ctx(opts, log, tmp, machine, start + min(caps[check.name], max(0.0, left)))
        if (opts.smoke and check.needs_cuda) or no_cuda:
            outcome = Outcome("SKIP", "needs CUDA")
        elif opts.dry_run:
            print(f"{check.name}:", flush=True)
            check.fn(ctx)
            outcome = Outcome("DRY", f"{len(ctx.steps)} step(s), not run")
        elif left < MIN_START_S:
            outcome = Outcome("SKIP", f"budget spent ({left:.0f} s left)")
        else:
            say(t0, f"{check.name}: start (timeout {min(caps[check.name], left):.0f} s)")
            try:
                outcome = check.fn(ctx)
            except Exception as e:  # a bug in the check's own logic must not stop the rest
                outcome = Outcome("FAIL", f"run_all error: {type(e).__name__}: {e}")
        seconds = time.monotonic() - start
        results[check.name] = {
            "status": outcome.status,
            "seconds": round(seconds, 1),
            "plan_s": check.plan_s,
            "summary": outcome.summary,
            "figures": outcome.figures,
            "steps": [_step_record(s) for s in ctx.steps],
        }
        say(t0, f"{check.name}: {outcome.status} in {seconds:.0f} s: {outcome.summary}")
        _write_json(out / "results.json", report)
    rows = ratios(results)
    report["ratios"] = rows
    report["total_s"] = round(time.monotonic() - t0, 1)
    _write_json(out / "results.json", report)
    table = render_table(results, rows)
    (out / "summary.md").write_text(table + "\n")
    log.close()
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{table}\n", flush=True)
    profile = results.get("profile", {}).get("figures") or {}
    if profile.get("top"):
        print(f"profile: top {len(profile['top'])} by time ({profile['source']}):\n"
              + kernel_table(profile) + "\n", flush=True)  # fmt: skip
    say(t0, f"done: total {report['total_s']:.0f} s; files in {out}: checks.log, results.json, "
        "summary.md")  # fmt: skip
    failed = [n for n, r in results.items() if r["status"] in ("FAIL", "TIMEOUT")]
    return 1 if failed else 0


def _step_record(s: StepResult) -> dict:
    rec = {k: v for k, v in asdict(s).items() if k not in ("tail", "results")}
    rec["argv"] = " ".join(s.argv)
    if not s.ok:
        rec["error"] = s.error_line()[:300]
    return rec


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
