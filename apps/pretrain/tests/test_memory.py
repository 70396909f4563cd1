"""pentatron-memory without processes: the 6 + 12/d rule, Korthikanti, presets, errors."""

from __future__ import annotations

import json

import pytest

from pentatron.pretrain.memory import korthikanti_per_layer, memory_report
from pentatron.pretrain.memory.cli import build_plan, main

GPT3 = [
    "--preset",
    "gpt3-175b",
    "--world-size",
    "1024",
    "--tensor-model-parallel-size",
    "8",
    "--pipeline-model-parallel-size",
    "8",
    "--sequence-parallel",
    "--use-distributed-optimizer",
    "--recompute-granularity",
    "selective",
    "--bf16",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "1536",
]


def _gpt3_stage0_params() -> int:
    """GPT-3 175B, tp 8, stage 0 of 8: embedding (V 50257 -> 51200), positions, 12 layers."""
    h, t, s = 12288, 8, 2048
    layer = (3 * h * h + 3 * h) // t + h * h // t + h  # qkv (+bias), proj (+ full bias)
    layer += (4 * h * h + 4 * h) // t + 4 * h * h // t + h  # fc1 (+bias), fc2 (+ full bias)
    layer += 2 * 2 * h  # two LayerNorms, weight and bias
    return 51200 // t * h + s * h + 12 * layer


def test_gpt3_static_bytes_follow_6_plus_12_over_d():
    plan, _ = build_plan(GPT3)
    assert (plan.dp, plan.tp, plan.pp) == (16, 8, 8)
    stages = memory_report(plan)
    loaded = max(stages, key=lambda s: s.num_parameters)
    n = _gpt3_stage0_params()
    assert loaded.stage == 0 and loaded.num_parameters == n
    static = loaded.weights_bytes + loaded.grads_bytes + loaded.main_params_bytes
    static += loaded.optimizer_bytes
    # Exactly 6 + 12/d per parameter, up to the buffer's alignment padding and Adam's
    # 4-byte step counters (well under 0.01 %).
    assert static == pytest.approx(n * (6 + 12 / 16), rel=1e-4)
    assert loaded.grads_bytes == pytest.approx(4 * n, rel=1e-4)


def test_gpt3_korthikanti_with_sp_and_selective():
    plan, _ = build_plan(GPT3)
    s, b, h, t = 2048, 1, 12288, 8
    per_layer = s * b * h * 34 / t  # SP divides all of it; selective drops 5as/h
    for stage in memory_report(plan):
        in_flight = 8 - stage.stage  # 1F1B: min(p - r, m), m = 1536 / 16 = 96
        assert stage.microbatches_in_flight == in_flight
        assert stage.korthikanti_activations_bytes == int(12 * per_layer * in_flight)


def test_korthikanti_textbook_forms():
    s, b, h, a = 2048, 1, 12288, 96
    assert korthikanti_per_layer(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert korthikanti_per_layer(s, b, h, a, t=8, sp=True) == s * b * h * (34 + 5 * a * s / h) / 8
    assert korthikanti_per_layer(s, b, h, a, 8, True, "selective") == s * b * h * 34 / 8
    assert korthikanti_per_layer(s, b, h, a, 8, True, "full") == 2 * s * b * h


def test_interleaving_holds_more_microbatches():
    flags = [
        "--num-layers",
        "8",
        "--pipeline-model-parallel-size",
        "4",
        "--world-size",
        "4",
        "--global-batch-size",
        "32",
        "--micro-batch-size",
        "1",
    ]
    plain = memory_report(build_plan(flags)[0])
    inter = memory_report(build_plan([*flags, "--virtual-pipeline-model-parallel-size", "2"])[0])
    assert [s.microbatches_in_flight for s in plain] == [4, 3, 2, 1]
    # Stage 0: warm-up (4-0-1)*2 + (2-1)*4 = 10 chunk-forwards + 1, over 2 chunks.
    assert inter[0].microbatches_in_flight == pytest.approx(11 / 2)


@pytest.mark.parametrize(
    "name", ["gpt3-175b", "llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b", "deepseek-v3"]
)
def test_presets_run_as_json(name, capsys):
    moe = ["--expert-model-parallel-size", "8", "--sequence-parallel"]
    extra = {"mixtral-8x7b": moe, "deepseek-v3": moe}.get(name, [])
    argv = [
        "--preset",
        name,
        "--world-size",
        "64",
        "--tensor-model-parallel-size",
        "8",
        "--bf16",
        "--use-distributed-optimizer",
        "--json",
        *extra,
    ]
    if name in ("llama3-405b", "deepseek-v3", "gpt3-175b"):
        argv[4:6] = ["--pipeline-model-parallel-size", "1"]
        argv += ["--tensor-model-parallel-size", "8"]
    assert main(argv) == 0
    stages = json.loads(capsys.readouterr().out)
    for s in stages:
        for key in (
            "stage",
            "num_parameters",
            "weights_bytes",
            "grads_bytes",
            "main_params_bytes",
            "optimizer_bytes",
            "activations_bytes",
            "total_bytes",
        ):
            assert key in s and s[key] >= 0


def test_llama3_8b_parameter_count():
    plan, _ = build_plan(["--preset", "llama3-8b", "--bf16"])
    (stage,) = memory_report(plan)
    assert stage.num_parameters == 8_030_261_248  # Meta's published count


def test_hf_config_and_plot(tmp_path, capsys):
    cfg = {
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 512,
        "vocab_size": 1000,
        "max_position_embeddings": 512,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    png = tmp_path / "mem.png"
    argv = [
        "--hf-config",
        str(path),
        "--pipeline-model-parallel-size",
        "4",
        "--world-size",
        "8",
        "--global-batch-size",
        "16",
        "--plot",
        str(png),
        "--device-memory-gb",
        "1",
    ]
    assert main(argv) == 0
    assert png.stat().st_size > 1000
    assert "stage" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--preset", "gpt5"], "--preset=gpt5: unknown preset"),
        (["--world-size", "6", "--tensor-model-parallel-size", "4"], "divisible by tp*cp*pp"),
        (
            [
                "--num-attention-heads",
                "6",
                "--hidden-size",
                "96",
                "--tensor-model-parallel-size",
                "4",
                "--world-size",
                "4",
            ],
            "--num-attention-heads=6",
        ),
        (
            ["--num-layers", "5", "--pipeline-model-parallel-size", "2", "--world-size", "2"],
            "--num-layers=5",
        ),
        (["--world-size", "0"], "--world-size=0"),
        (["--use-torch-fsdp2", "--world-size", "2"], "--use-torch-fsdp2"),
    ],
)
def test_bad_input_is_a_clear_error(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


MOE_SMALL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "30",
    "--micro-batch-size",
    "2",
    "--world-size",
    "2",
    "--num-experts",
    "8",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "64",
    "--expert-model-parallel-size",
    "2",
    "--moe-token-dispatcher-type",
    "alltoall",
]


@pytest.mark.parametrize(
    "extra,want_rows",
    [
        ([], 60 * 2),  # no capacity: every one of T = 60 tokens goes to exactly k = 2 experts
        # cf 0.5: C = ceil(60 * 2 * 0.5 / 8) = 8 per expert; dropping keeps at most 8 * 8
        (["--moe-expert-capacity-factor", "0.5"], 8 * 8),
        # cf 2 padded to capacity: C = ceil(60 * 2 * 2 / 8) = 30, every expert gets 30 rows
        (["--moe-expert-capacity-factor", "2", "--moe-pad-expert-input-to-capacity"], 8 * 30),
    ],
)
def test_moe_routed_rows_use_topk_or_the_capacity_bound(extra, want_rows):
    from pentatron.pretrain.memory.activations import _routed_rows

    plan, _ = build_plan(MOE_SMALL + extra)
    assert _routed_rows(plan, 30 * 2) == (want_rows, want_rows)
