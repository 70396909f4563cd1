"""The app's real training step on a fake GPU, on the CPU: device bugs fail here, not on a
cluster.

Each case runs `_dry_run.run` in a fresh process (forked from the test harness's server,
with torch already imported): the app's `pretrain()` (initialize, get_model with DDP chunks
and the distributed optimizer, the pipeline schedule, the step's reductions, the optimizer
step, a checkpoint save) as chosen ranks of a fake world of 8
(tp2 x pp2 with 2 virtual stages x dp2, SP, overlapped grad reduce and param gather; the
same under ZBV's V with its second p2p group and the loss moved to the last rank) or 4
(MoE: tp2 x ep2, all-to-all dispatcher, grouped GEMM; context parallelism: cp2 x tp2, the
ring or the all-gather kind, with gpt-oss's sinks and windows; hierarchical cp4, a2a+p2p),
in bf16 (and fp16 with dynamic loss scaling at tp2-pp2-dp2) on `meta` tensors with
torch's fake process group (`pentatron.parallel_state.testing.fake_device`). A rank
fails on what fails or crawls on a GPU: a host tensor handed to a compute collective (the
fake group rejects it with NCCL's error), a host tensor in a device op, an fp32 GEMM of
model size in a bf16 model, SDPA's math fallback. Host reads of device memory are counted
per step. Ranks 0 and 7 of the dense world cover both tp ranks, both pipeline stages and
both dp ranks.

The planted cases re-introduce, one at a time, the defects the first GPU run found (the
batch left on the host, the step's flags all-reduced from the host, the weight gradient
as an fp32 GEMM, an MoE parameter made on the host) and two more (a host read per
micro-batch; fp16's inverse loss scale made on the host); each must fail.
"""

from __future__ import annotations

import os
import sys

import pytest

from pentatron.parallel_state.testing import run_in_fresh_process

sys.path.insert(0, os.path.dirname(__file__))

import _dry_run


def dry_run(tmp_path, layout: str, ranks: str, plant: str = "none", *extra: str) -> dict:
    return run_in_fresh_process(_dry_run.run, layout, ranks, plant, str(tmp_path), list(extra))


def _ok(result: dict) -> dict:
    for rank, r in result.items():
        assert "error" not in r, f"rank {rank}: {r['error']}\n{r['trace']}"
    return result


def test_dense_step_runs_on_the_fake_gpu(tmp_path):
    result = _ok(dry_run(tmp_path, "tp2-pp2-dp2", "0,7"))
    for rank, r in result.items():
        assert r["iterations"] == 2
        # Every GEMM of the model took bf16 operands (the rule raises otherwise).
        assert r["gemm_dtypes"] == ["torch.bfloat16"], (rank, r["gemm_dtypes"])
        # Host reads per step: the step's verdict + loss (one read) and the grad norm.
        assert r["reads_per_step"] == [2, 2], (rank, r["reads_per_step"])
    # The checkpoint of the last iteration was written (rank by rank).
    assert os.path.isfile(tmp_path / "rank0" / "latest_checkpointed_iteration.txt")


def test_host_reads_do_not_grow_with_micro_batches(tmp_path):
    """4 micro-batches per step (global batch 16) read the host as often as 2 do."""
    four = _ok(dry_run(tmp_path, "tp2-pp2-dp2", "7", "none", "--global-batch-size", "16"))
    assert four[7]["reads_per_step"] == [2, 2]


def test_zbv_step_runs_on_the_fake_gpu(tmp_path):
    """ZBV at tp2-pp2-dp2: ranks 0 (pipeline rank 0: embedding, loss) and 7 (the V's turn)."""
    result = _ok(dry_run(tmp_path, "zbv-tp2-pp2-dp2", "0,7"))
    for rank, r in result.items():
        assert r["iterations"] == 2
        assert r["gemm_dtypes"] == ["torch.bfloat16"], (rank, r["gemm_dtypes"])
        assert r["reads_per_step"] == [2, 2], (rank, r["reads_per_step"])


def test_custom_pipeline_layout_step_runs_on_the_fake_gpu(tmp_path):
    """A chunk without layers or parameters (rank 0's second) and one with only the loss
    (rank 7's second) keep to the device's rules, with ZeRO-1's overlapped buckets."""
    result = _ok(dry_run(tmp_path, "layout-tp2-pp2-dp2", "0,7"))
    for rank, r in result.items():
        assert r["iterations"] == 2
        assert r["gemm_dtypes"] == ["torch.bfloat16"], (rank, r["gemm_dtypes"])
        assert r["reads_per_step"] == [2, 2], (rank, r["reads_per_step"])


def test_moe_step_runs_on_the_fake_gpu(tmp_path):
    """MoE, with gpt-oss's attention and GLU variants on (learnable sinks: their padded q/k/v
    and sink key; a sliding window on every second layer: its mask; the GLU clamp): all made
    on the device, and no SDPA math fallback (the masked kernel is the efficient one)."""
    gpt_oss = ["--softmax-type", "learnable", "--window-size", "7,0"]
    gpt_oss += ["--window-attn-skip-freq", "2", "--activation-func-clamp-value", "7.0"]
    result = _ok(dry_run(tmp_path, "moe-tp2-ep2", "0,3", "none", *gpt_oss))
    for r in result.values():
        assert r["iterations"] == 2


@pytest.mark.parametrize("kind", ["p2p", "all_gather"])
def test_context_parallel_step_runs_on_the_fake_gpu(tmp_path, kind):
    """cp2 x tp2 (SP, ZeRO-1) with gpt-oss's sinks and windows: the ring's sends (or the
    all-gather and reduce-scatter of K|V), the windowed blocks' GEMMs on bf16 operands
    with fp32 sums (models before 0.7.0 widened q, k, v to fp32: CUDA cores, caught here),
    the windows' masks made on the device, the other layers' blocks through the CUDA flash
    kernel's calls (models 0.7.1); only the step's own host reads."""
    gpt_oss = ["--softmax-type", "learnable", "--window-size", "7,0"]
    gpt_oss += ["--window-attn-skip-freq", "2", "--transformer-impl", "local"]
    result = _ok(dry_run(tmp_path, "cp2-tp2", "0,3", "none", "--cp-comm-type", kind, *gpt_oss))
    for rank, r in result.items():
        assert r["iterations"] == 2
        assert r["gemm_dtypes"] == ["torch.bfloat16"], (rank, r["gemm_dtypes"])
        assert r["reads_per_step"] == [2, 2], (rank, r["reads_per_step"])
        # the unwindowed layers' blocks take CUDA's flash kernel (its meta kernels here):
        # 2 layers x 2 steps x 4 micro-batches (global batch 8 of 2, dp 1) x (cp = 2)
        # pairs, forward and backward
        assert r["cp_kernels"] == {"flash_cuda fwd": 32, "flash_cuda bwd": 32}, (rank, r)


def test_hierarchical_cp_step_runs_on_the_fake_gpu(tmp_path):
    """cp4 with a2a+p2p (2 x 2) and gpt-oss's sinks: the all-to-alls over the hcp0 group,
    the ring's sends over hcp1, every block on CUDA's flash kernel: the 4 layers x 2 steps x
    4 micro-batches x (ring size 2) pairs, forward and backward; ranks 0 and 3 are the two
    ends of both levels."""
    sinks = ["--softmax-type", "learnable", "--transformer-impl", "local"]
    result = _ok(dry_run(tmp_path, "hcp4", "0,3", "none", *sinks))
    for rank, r in result.items():
        assert r["iterations"] == 2
        assert r["gemm_dtypes"] == ["torch.bfloat16"], (rank, r["gemm_dtypes"])
        assert r["reads_per_step"] == [2, 2], (rank, r["reads_per_step"])
        assert r["cp_kernels"] == {"flash_cuda fwd": 64, "flash_cuda bwd": 64}, (rank, r)


def test_mla_step_runs_on_the_fake_gpu(tmp_path):
    """MLA's latents, all-gathers and YaRN tables, and MTP's rolled inputs, embedding copy
    and its loss, made on the device; bf16 GEMMs only."""
    result = _ok(dry_run(tmp_path, "mla-tp2-pp2-dp2", "0,7"))
    for rank, r in result.items():
        assert r["iterations"] == 2
        assert r["gemm_dtypes"] == ["torch.bfloat16"], (rank, r["gemm_dtypes"])


def test_fp16_step_runs_on_the_fake_gpu(tmp_path):
    """--fp16 (dynamic loss scaling) at tp2-pp2-dp2 with SP and the distributed optimizer:
    fp16 GEMMs only, and one host read more per step than bf16 (the unscale's overflow
    verdict, agreed over the grid)."""
    result = _ok(dry_run(tmp_path, "fp16-tp2-pp2-dp2", "0,7"))
    for rank, r in result.items():
        assert r["iterations"] == 2
        assert r["gemm_dtypes"] == ["torch.float16"], (rank, r["gemm_dtypes"])
        assert r["reads_per_step"] == [3, 3], (rank, r["reads_per_step"])


PLANTS = {
    # the batch built on the host: tp rank 0 broadcasts it over tp from the host
    "batch-on-host": ("0", "broadcast over group 'tp'", "device type cpu"),
    # the step's NaN flags made on the host and all-reduced over the world's compute group
    "host-tensor-collective": ("0", "all_reduce over group 'world'", "device type cpu"),
    # dW = dY^T X with operands widened to fp32
    "fp32-wgrad": ("7", "fp32 GEMM", "addmm"),
    # an MoE router weight made on the host: DDP cannot put it in its device buffer
    "moe-param-on-host": ("0", "set_data", ""),
    # fp16: the loss scale's inverse made on the host for the unscale kernel
    "fp16-inv-scale-on-host": ("0", "non_finite_check_and_unscale", "host tensor"),
}
LAYOUT_OF_PLANT = {"moe": "moe-tp2-ep2", "fp16": "fp16-tp2-pp2-dp2"}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_each_planted_defect_fails(tmp_path, plant):
    rank, *needles = PLANTS[plant]
    layout = LAYOUT_OF_PLANT.get(plant.split("-")[0], "tp2-pp2-dp2")
    result = dry_run(tmp_path, layout, rank, plant)
    error = result[int(rank)].get("error", "")
    assert error, f"{plant}: the dry run passed with the defect planted"
    for needle in needles:
        assert needle in error, (plant, error)


def test_a_host_read_per_micro_batch_is_seen(tmp_path):
    """Planted: the loss read on the host in every micro-batch; the step's count grows."""
    result = _ok(dry_run(tmp_path, "tp2-pp2-dp2", "7", "sync-per-microbatch"))
    assert result[7]["reads_per_step"] == [4, 4]  # 2 micro-batches -> 2 more reads
