"""tools/device_checks/run_all.py, the GPU device-check entry point, proven on CPU.

GPU time is short, so what can go wrong before a GPU is reached is checked here:
- every command line the GPU run would start for the app is accepted by the app's own
  argument rules (`validate_args` as on a CUDA machine), and the `app` run's model is the
  plain loop's (`benchmarks/gpu_mfu.py`) field for field, with no vocabulary padding;
- the kernel-name rules, the metrics summary and the example-config rewrite;
- `run_all.py --smoke --only app,sdpa,wgrad,cp-blocks,variants` end to end in a subprocess
  (tiny app run on CPU, a CUDA-only check skipped, script checks, cp's fused blocks against
  the maths, gpt-oss's attention against its fp32 reference): the table, results.json,
  few files;
- a step past its timeout is killed with the processes it started.
`tools/` lives in the repository, not in the wheel's test copy: marked `checkout` (run by
`nox -s "checkout(pretrain)"`, deselected in the standalone session).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.checkout
TOOLS = Path(__file__).resolve().parents[3] / "tools" / "device_checks"


@pytest.fixture(scope="module")
def tools():
    """run_all, _kernels, _app_runs, _paths imported from tools/device_checks."""
    saved = list(sys.path)
    sys.path.insert(0, str(TOOLS))
    try:
        import _app_runs
        import _kernels
        import _paths
        import run_all

        yield {"run_all": run_all, "kernels": _kernels, "app": _app_runs, "paths": _paths}
    finally:
        sys.path[:] = saved


def _app_argv(argv: list[str]) -> list[str] | None:
    """The app flags of a planned step (an app run, or profile_app.py's after `--`)."""
    if "pentatron.pretrain" in argv:
        return argv[argv.index("pentatron.pretrain") + 1 :]
    if argv[1].endswith("profile_app.py"):
        return argv[argv.index("--") + 1 :]
    return None


def test_every_gpu_app_command_line_is_valid(tools, tmp_path):
    from pentatron.pretrain.arguments import parse_args, validate_args

    steps = tools["run_all"].plan_steps(smoke=False, tmp=tmp_path)
    seen = set()
    for check, step in steps:
        flags = _app_argv(step.argv)
        if flags is None:
            continue
        args = validate_args(parse_args(flags), 1, cuda=True)
        assert args.device == "cuda", (check, step.label)
        seen.add(step.label)
    assert {"app", "app-compile", "moe-app", "zero1-overlap", "fsdp2", "quickstart",
            "llama3-8b-like", "mixtral-8x7b-like", "profile"} <= seen  # fmt: skip


def test_app_runs_the_plain_loops_model(tools, tmp_path):
    """The `app` check's model is gpu_mfu's ISSUE_SHAPE model (the app / plain ratio
    compares the same model), ~0.89B parameters, 32000 vocabulary rows, no padding."""
    from pentatron.pretrain.arguments import parse_args, validate_args
    from pentatron.pretrain.training import configs
    from pentatron.tp_layers import pad_vocab_size

    gpu_mfu = tools["paths"].load_benchmark("gpu_mfu")
    (step,) = [s for c, s in tools["run_all"].plan_steps(False, tmp_path) if c == "app"]
    args = validate_args(parse_args(_app_argv(step.argv)), 1, cuda=True)
    ours = configs.transformer_config(args)
    plain = gpu_mfu.model_config(gpu_mfu.ISSUE_SHAPE)
    assert dataclasses.asdict(ours) == dataclasses.asdict(plain)
    assert args.vocab_size + 1 == gpu_mfu.ISSUE_SHAPE.vocab  # NullTokenizer adds the eod id
    assert pad_vocab_size(args.vocab_size + 1, 1, args.make_vocab_size_divisible_by) == 32000
    h, f, v, L = 2048, 5632, 32000, 16
    params = 2 * v * h + L * (h * (h + 2 * 1024) + h * h + 3 * h * f + 2 * h) + h
    assert 0.88e9 < params < 0.90e9
    assert args.global_batch_size // args.micro_batch_size == 4


def test_kernel_names(tools):
    k = tools["kernels"]
    simt = [
        "ampere_sgemm_128x64_nn",
        "cutlass_80_simt_sgemm_128x64_8x5_nn_align1",
        "sm90_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize64x64x8_ffma_cublas",
    ]
    tensor_core = [
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1",
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT",
        "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn",
        "sm80_xmma_gemm_tf32f32_tf32f32_f32_nn_n_tilesize128x128x16",
        "void at::native::vectorized_elementwise_kernel<4, float>",
    ]
    assert all(k.is_fp32_simt_gemm(n) for n in simt)
    assert not any(k.is_fp32_simt_gemm(n) for n in tensor_core)
    assert k.is_nccl("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
    assert k.sdpa_backend(["void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>"]) == (
        "flash"
    )
    assert k.sdpa_backend(["fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::"
                           "AttentionKernel<float, cutlass::arch::Sm80>)"]) == "efficient"  # fmt: skip
    assert k.sdpa_backend(["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16"]) == (
        "cudnn"
    )
    assert k.sdpa_backend(["ampere_bf16_s16816gemm", "softmax_warp_forward"]) == "math"
    summary = k.summarize({"ampere_sgemm_x": {"us": 30.0, "calls": 3},
                           "ncclDevKernel_x": {"us": 10.0, "calls": 1},
                           "nvjet_bf16": {"us": 60.0, "calls": 6}})  # fmt: skip
    assert summary["fp32_simt_gemm_share"] == pytest.approx(0.3)
    assert summary["nccl_share"] == pytest.approx(0.1)
    assert [r["name"] for r in summary["top"]] == [
        "nvjet_bf16",
        "ampere_sgemm_x",
        "ncclDevKernel_x",
    ]


def test_metrics_summary_skips_warmup_and_reads_the_loss_trend(tools):
    a = tools["app"]
    recs = [
        {"iteration": i, "split": "train", "lm_loss": 10.0 - i, "tokens_per_s": 100.0 * i,
         "iteration_time_s": 1.0 / i, "tflops_per_device": 2.0 * i, "memory_bytes": 2**30}
        for i in range(1, 7)
    ]  # fmt: skip
    m = a.summarize(recs, warmup=3, peak_tflops=10.0)
    assert m["timed_iterations"] == 3 and m["tokens_per_s"] == 500.0
    assert m["tflops"] == 10.0 and m["mfu"] == 1.0 and m["iteration_ms"] == 200.0
    assert m["loss_first"] == 9.0 and m["loss_last"] == 4.5 and m["loss_down"]
    flat = a.summarize([{**r, "lm_loss": 5.0} for r in recs], 3, None)
    assert not flat["loss_down"] and flat["mfu"] is None
    assert a.summarize([], 3, 989.0)["iterations"] == 0


def test_derived_config_drops_only_the_named_keys(tools, tmp_path):
    from pentatron.pretrain.arguments import parse_args

    a = tools["app"]
    src = TOOLS.parents[1] / "examples" / "configs" / "quickstart-cpu.yaml"
    dst = a.derive_config(src, ("num-layers-per-virtual-pipeline-stage", "sequence-parallel"),
                          tmp_path / "q.yaml")  # fmt: skip
    args, full = parse_args(["--config", str(dst)]), parse_args(["--config", str(src)])
    assert args.num_layers_per_virtual_pipeline_stage is None and not args.sequence_parallel
    assert full.num_layers_per_virtual_pipeline_stage == 1 and full.sequence_parallel
    for key in ("num_layers", "hidden_size", "global_batch_size", "lr", "save"):
        assert getattr(args, key) == getattr(full, key)


def test_smoke_run_end_to_end(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(TOOLS / "run_all.py"), "--out", str(out), "--smoke",
         "--only", "app,sdpa,wgrad,cp-blocks,variants"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "| check | result | s | key figures |" in proc.stdout
    assert "| app / plain tokens/s | n/a |" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["checks.log", "results.json", "summary.md"]
    report = json.loads((out / "results.json").read_text())
    checks = report["checks"]
    assert list(checks) == ["app", "sdpa", "wgrad", "cp-blocks", "variants"]
    app = checks["app"]
    assert app["status"] == "OK", app
    assert app["figures"]["tokens_per_s"] > 0 and app["figures"]["loss_down"]
    assert app["figures"]["iterations"] == 6 and app["figures"]["timed_iterations"] == 4
    assert checks["sdpa"] == {**checks["sdpa"], "status": "SKIP", "summary": "needs CUDA"}
    assert checks["wgrad"]["status"] in ("OK", "N/A"), checks["wgrad"]
    cp = checks["cp-blocks"]
    assert cp["status"] == "OK" and cp["summary"].startswith("float32 3 pairs fwd+bwd: "), cp
    for path in ("fused", "maths"):  # the fused kernels within fp32's 1e-5 of the maths
        assert cp["figures"][path]["ok"] and len(cp["figures"][path]["rel_errors"]) == 9
        assert max(cp["figures"][path]["rel_errors"].values()) <= 1e-5
    variants = checks["variants"]
    assert variants["status"] == "OK", variants
    assert variants["summary"].startswith("float32 fwd+bwd: causal "), variants
    for name in ("sinks", "window", "sinks+window"):  # each within the fp32 tolerance
        assert variants["figures"][name]["ok"] and variants["figures"][name]["rel_errors"]
        assert max(variants["figures"][name]["rel_errors"].values()) <= 1e-4
    assert report["mode"] == "smoke" and report["total_s"] < took + 1
    log = (out / "checks.log").read_text()
    assert "===== app (timeout" in log and "----- app: exit 0" in log


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to see the child die")
def test_a_step_past_its_timeout_is_killed_with_its_children(tools, tmp_path):
    """The step and everything it started (as torch.compile's workers) end at the timeout;
    its output so far is in the log and the result says timed out."""
    import _proc

    log = _proc.CombinedLog(tmp_path / "checks.log")
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); "
        "print('RESULT {\"partial\": 1}', flush=True); time.sleep(60)"
    )
    start = time.monotonic()
    res = _proc.run_step("sleeper", [sys.executable, "-c", code], log, 2.0, _proc.step_env())
    log.close()
    assert res.timed_out and not res.ok and time.monotonic() - start < 20
    assert res.result() == {"partial": 1}
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child)
    text = (tmp_path / "checks.log").read_text()
    assert "===== sleeper" in text and "sleeper: TIMED OUT" in text


def _alive(pid: int) -> bool:
    """Running and not a zombie (a killed child of the killed step waits for init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
