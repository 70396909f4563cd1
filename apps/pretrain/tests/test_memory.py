"""pentatron-memory without processes: the 6 + 12/d rule, Korthikanti, presets, errors."""

from __future__ import annotations

import json

import pytest

from pentatron.pretrain.memory import korthikanti_per_layer, memory_report
from pentatron.pretrain.memory.activations import chunk_activations
from pentatron.pretrain.memory.cli import build_plan, main

# A small Llama-style model (RoPE, RMSNorm, no dropout) where a test needs only the shape;
# tests then override what they measure.
SMALL = [
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "128", "--micro-batch-size", "2", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--hidden-dropout", "0", "--attention-dropout", "0",
]  # fmt: skip

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


def test_llama3_8b_fsdp2_is_16_over_d_plus_its_gathered_state():
    """FSDP2 over 64 ranks (Megatron-FSDP's Llama-3-8B example, ZeRO-3): fp32 params, grads
    and Adam's two moments sharded, 16/d bytes a parameter (up to the padding of rows to
    ceil(rows / 64) and Adam's step counters); plus the gathered state, by hand: the root
    (embedding, final norm, output layer) gathered in bf16, two layers (the one in backward
    and the one prefetched) and that layer's bf16 grads, with the final norm's and the
    output layer's grads; no activations counted in it."""
    plan, _ = build_plan(
        ["--preset", "llama3-8b", "--bf16", "--use-torch-fsdp2", "--world-size", "64"]
    )
    (stage,) = memory_report(plan)
    n = stage.num_parameters
    static = stage.weights_bytes + stage.grads_bytes + stage.optimizer_bytes
    assert stage.main_params_bytes == 0
    assert static == pytest.approx(16 * n / 64, rel=1e-4)
    h, v, f = 4096, 128256, 14336
    layer = 2 * h + (h + 2 * 1024) * h + h * h + 2 * f * h + f * h  # norms, qkv, proj, mlp
    root = 2 * v * h + h
    # every dim 0 here (128256, 6144, 28672, 4096) divides by 64: no padding
    assert stage.fsdp_gathered_bytes == 2 * (root + 2 * layer + layer + v * h + h)


def test_zero_bubble_h1_holds_1f1b_activations_and_up_to_r_pending_weight_gradients():
    """ZB-H1 at pp4, 8 micro-batches (the schedule's table, sized per rank): the saved
    activations peak as 1F1B's (p - r micro-batches); rank r keeps up to r W's pending, so
    r + 1 just before a W runs, and the store a rank adds at its peak grows with r, within
    those r + 1 micro-batches' W's (the exact bytes per W are measured in
    test_memory_measure.py). 1F1B sizes no store."""
    from pentatron.pretrain.memory.zero_bubble import wgrad_bytes

    argv = [*SMALL, "--pipeline-model-parallel-size", "4", "--transformer-impl", "local"]
    argv += ["--global-batch-size", "16", "--world-size", "4"]
    one_f_one_b = memory_report(build_plan(argv)[0])
    plan, _ = build_plan([*argv, "--pipeline-schedule", "zb-h1"])
    stages = memory_report(plan)
    for r, (zb, ref) in enumerate(zip(stages, one_f_one_b)):
        assert ref.wgrad_store_bytes == 0
        assert zb.activations_bytes == ref.activations_bytes
        assert zb.microbatches_in_flight == 4 - r
        assert 0 < zb.wgrad_store_bytes <= (r + 1) * wgrad_bytes(plan, r, 0)
    store = [st.wgrad_store_bytes for st in stages]
    assert store == sorted(store) and store[0] < store[3], store


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
        *SMALL,
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
    plan = build_plan([*flags, "--virtual-pipeline-model-parallel-size", "2"])[0]
    inter = memory_report(plan)
    assert [s.microbatches_in_flight for s in plain] == [4, 3, 2, 1]
    # Stage 0: warm-up (4-0-1)*2 + (2-1)*4 = 10 chunk-forwards + 1. In groups of pp = 4,
    # forwards run chunk 0 of micro-batches 0-3, chunk 1 of 0-3, chunk 0 of 4-7, ...;
    # backwards chunk 1 of 0-3 first. Chunk 0 also holds the embedding's bytes, so the peak
    # is after the 12th forward and the first backward: 8 of chunk 0 and 3 of chunk 1, in
    # units of both chunks.
    a0, a1 = (chunk_activations(plan, 0, vp).total for vp in (0, 1))
    assert a0 > a1
    assert inter[0].microbatches_in_flight == pytest.approx((8 * a0 + 3 * a1) / (a0 + a1))
    assert inter[0].microbatches_in_flight == pytest.approx(11 / 2, rel=0.01)


@pytest.mark.parametrize(
    "name",
    [
        "gpt3-175b",
        "llama3-8b",
        "llama3-70b",
        "llama3-405b",
        "mixtral-8x7b",
        "deepseek-v3",
        "gpt-oss-20b",
        "gpt-oss-120b",
    ],
)
def test_presets_run_as_json(name, capsys):
    moe = ["--expert-model-parallel-size", "8", "--sequence-parallel"]
    extra = moe if name.startswith(("mixtral", "deepseek", "gpt-oss")) else []
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


TERMS = (
    "weights_bytes",
    "grads_bytes",
    "main_params_bytes",
    "optimizer_bytes",
    "fp8_weight_cache_bytes",
    "fsdp_gathered_bytes",
    "wgrad_store_bytes",
    "activations_bytes",
    "comm_buffers_bytes",
)


@pytest.mark.parametrize("gib", [1, 0.75])
def test_headroom_is_device_gib_minus_total(gib, capsys):
    argv = [*SMALL, "--num-layers", "4", "--pipeline-model-parallel-size", "2", "--world-size", "2"]
    argv += ["--global-batch-size", "8", "--device-memory-gb", str(gib), "--json"]
    assert main(argv) == 0
    stages = json.loads(capsys.readouterr().out)
    assert len(stages) == 2
    for s in stages:
        assert s["total_bytes"] == sum(s[k] for k in TERMS)
        # --device-memory-gb is in GiB: 2**30 bytes each
        assert s["headroom_bytes"] == int(gib * 1024**3) - s["total_bytes"]
    assert main([*argv[:-3], "--json"]) == 0
    assert all(s["headroom_bytes"] is None for s in json.loads(capsys.readouterr().out))


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--preset", "gpt5"], "--preset=gpt5: unknown preset"),
        (["--world-size", "6", "--tensor-model-parallel-size", "4"], "divisible by tp*cp*pp"),
        (
            [
                *SMALL,
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
            [
                *SMALL,
                "--num-layers",
                "5",
                "--pipeline-model-parallel-size",
                "2",
                "--world-size",
                "2",
            ],
            "--num-layers=5",
        ),
        (["--world-size", "0"], "--world-size=0"),
        (
            [
                *(*SMALL, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"),
                *("--num-experts", "4", "--transformer-impl", "local"),
            ],
            "--num-experts with --pipeline-schedule zb-h1: the weight-gradient store is sized",
        ),
        (  # sized as core_attn it would be wrong: core attention stays stored
            [*SMALL, "--recompute-granularity", "selective", "--recompute-modules", "mlp"],
            "--recompute-modules mlp: selective recompute is sized for core_attn",
        ),
        (
            [
                *(*SMALL, "--recompute-granularity", "selective"),
                *("--recompute-modules", "core_attn", "mlp", "layernorm"),
            ],
            "--recompute-modules layernorm mlp: selective",
        ),
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


# --- preset / HF values are defaults: the command line and --config win -----------------

TP8 = ["--tensor-model-parallel-size", "8", "--world-size", "8"]


@pytest.mark.parametrize(
    "flags,field,want",
    [
        # each value equals the app's parser default, which must not hide that it was given
        (["--position-embedding-type", "rope"], "position_embedding_type", "rope"),
        (["--seq-length", "128"], "seq_length", 128),
        (["--seq-length=128"], "seq_length", 128),
    ],
)
def test_command_line_beats_the_preset_even_at_the_parser_default(flags, field, want):
    plan, args = build_plan(["--preset", "gpt3-175b", *TP8, *flags])
    assert getattr(args, field) == want
    if field == "seq_length":
        assert plan.seq_length == want
    else:
        assert plan.config.position_embedding_type == want and plan.seq_length == 2048
    # the preset's other values stay: 96 layers of h 12288, LayerNorm
    assert (plan.config.num_layers, plan.config.hidden_size) == (96, 12288)
    assert plan.config.normalization == "LayerNorm"


def test_a_flag_prefix_is_not_taken_for_the_flag(capsys):
    """No prefix matching, as Megatron-LM's parser: `--seq-len` is not `--seq-length`."""
    with pytest.raises(SystemExit):
        build_plan(["--preset", "gpt3-175b", *TP8, "--seq-len", "128"])
    assert "--seq-len" in capsys.readouterr().err


def test_config_yaml_beats_the_preset_and_the_command_line_beats_yaml(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("position_embedding_type: rope\nseq_length: 128\nnum_layers: 8\n")
    plan, _ = build_plan(["--config", str(cfg), "--preset", "gpt3-175b", *TP8])
    assert plan.config.position_embedding_type == "rope"  # YAML, = parser default
    assert (plan.seq_length, plan.config.num_layers) == (128, 8)
    assert plan.config.hidden_size == 12288  # not in the YAML: the preset's
    plan, _ = build_plan(
        ["--config", str(cfg), "--preset", "gpt3-175b", *TP8, "--seq-length", "64"]
    )
    assert plan.seq_length == 64
    # the preset itself may come from the YAML
    cfg.write_text("preset: gpt3-175b\nseq_length: 128\n")
    plan, _ = build_plan(["--config", str(cfg), *TP8])
    assert (plan.config.num_layers, plan.seq_length) == (96, 128)


def test_moe_flag_at_its_default_beats_the_preset():
    argv = ["--preset", "deepseek-v3", "--tensor-model-parallel-size", "8", "--world-size", "64"]
    argv += ["--expert-model-parallel-size", "8"]
    argv += ["--sequence-parallel", "--pipeline-model-parallel-size", "1"]
    assert build_plan(argv)[0].config.moe_router_topk == 8  # the preset's
    # 2 is the app's default for --moe-router-topk; given, it wins (with a group top-k
    # that fits it: the preset's 4 of 8 groups needs top-k >= 4)
    given = [*argv, "--moe-router-topk", "2", "--moe-router-group-topk", "2"]
    assert build_plan(given)[0].config.moe_router_topk == 2


# --- GPT-3 175B activations against Korthikanti, from the CLI's JSON ---------------------


def test_gpt3_cli_activations_are_korthikanti_plus_documented_terms(capsys):
    """tp8 pp8 dp16, distributed optimizer, SP, selective recompute, bf16 (e = 2), dropout 0
    (the app's default). Korthikanti's layer with SP + selective: 34 sbh/t bytes. Ours
    differs by documented terms only (docs/memory.md, "GPT-3 175B against Korthikanti"):
    - each LayerNorm keeps its input in bf16, 2 bytes as Korthikanti counts (one autograd
      function, as Megatron's fused kernel; it used to keep an fp32 copy, 4 bytes);
    - - 2 x 1 sbh/t: no dropout masks (Korthikanti counts two 1-byte hidden-dropout masks);
    - + 2 x 8 s'b: each LayerNorm's fp32 mean and rstd;
    - stage 0 once per micro-batch: the embedding's local ids (int64) and foreign mask 9 sb,
      and the int64 batch [4, b, s] that the learned positions' lookup keeps, 32 sb;
    so the sbh terms are 32/34 of Korthikanti (-5.9 %) and the small ones add < 0.2 %."""
    assert main([*GPT3, "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)
    s, b, h, t, p = 2048, 1, 12288, 8, 8
    layers, sbh_t = 96 // p, s * b * h // t
    korthikanti_layer = 34 * sbh_t
    ours_layer = korthikanti_layer - 2 * sbh_t + 2 * 8 * (s // t) * b
    loaded = max(stages, key=lambda x: x["activations_bytes"])
    assert loaded["stage"] == 0 and loaded["microbatches_in_flight"] == p  # 1F1B: p on stage 0
    assert loaded["activations_bytes"] == p * (layers * ours_layer + (9 + 32) * s * b)
    korthikanti = p * layers * korthikanti_layer  # 10,267,656,192 bytes
    assert loaded["korthikanti_activations_bytes"] == korthikanti
    assert loaded["activations_bytes"] / korthikanti == pytest.approx(32 / 34, rel=2e-3)
    last = stages[-1]  # 1 in flight; + final LayerNorm and the fp32 logits' softmax
    v = 51200 // t  # V 50257 padded to a multiple of 128 x 8
    final_norm = 4 * (s // t) * b * h + 8 * (s // t) * b  # input, output; mean, rstd
    output = 4 * s * b * v + 13 * s * b + 4  # softmax, labels, foreign and loss masks, count
    assert last["activations_bytes"] == layers * ours_layer + final_norm + output


# --- Hugging Face config.json -------------------------------------------------------------


def _hf(tmp_path, capsys, cfg: dict, *flags: str) -> int:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    plan, _ = build_plan(["--hf-config", str(path), *flags])
    return sum(s.num_parameters for s in memory_report(plan))


def _hf_model_params(cfg: dict) -> int:
    import transformers  # the test extra has it: an independent reference, not a dependency

    AutoConfig, AutoModelForCausalLM = transformers.AutoConfig, transformers.AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    return sum(p.numel() for p in model.parameters())


# L 2, h 64, 4 heads of 16, 2 kv groups, ffn 96, V 512 (a multiple of 128: no padding)
TINY_HF = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "vocab_size": 512,
    "max_position_embeddings": 32768,
}
L, H, KV, F, V = 2, 64, 2 * 16, 96, 512
ATTN = H * H + 2 * KV * H + H * H  # q, k, v, o
EMBED = 2 * V * H + H  # untied embedding and output layer, final norm


def test_hf_llama_parameter_count(tmp_path, capsys):
    cfg = {**TINY_HF, "model_type": "llama"}
    want = EMBED + L * (ATTN + 3 * F * H + 2 * H)  # gate, up, down; two RMSNorms
    assert _hf(tmp_path, capsys, cfg) == want == _hf_model_params(cfg)


def test_hf_qwen2_has_qkv_biases(tmp_path, capsys):
    cfg = {**TINY_HF, "model_type": "qwen2"}  # no attention_bias key: Qwen2 always has them
    want = EMBED + L * (ATTN + (H + 2 * KV) + 3 * F * H + 2 * H)
    assert _hf(tmp_path, capsys, cfg) == want == _hf_model_params(cfg)


def test_hf_mixtral_is_moe(tmp_path, capsys):
    cfg = {**TINY_HF, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
    want = EMBED + L * (ATTN + 4 * H + 4 * 3 * F * H + 2 * H)  # router [E, h], E experts
    assert _hf(tmp_path, capsys, cfg) == want == _hf_model_params(cfg)


def test_hf_gpt_oss_sizes_its_variants(tmp_path, capsys):
    """gpt-oss: biases everywhere, a sink per head, 4 experts with biases and the router's
    bias; its windows, sinks, clamp and YaRN reach the plan (the activation bytes of those
    are measured exact in test_memory_measure)."""
    cfg = {**TINY_HF, "model_type": "gpt_oss", "num_local_experts": 4, "head_dim": 16}
    cfg.update(num_experts_per_tok=2, sliding_window=128, swiglu_limit=7.0)
    attn = ATTN + (H + 2 * KV) + H + 4  # + q/k/v and o biases, 4 sinks
    moe = 4 * H + 4 + 4 * (3 * F * H + 2 * F + H)  # router + bias, experts + biases
    want = EMBED + L * (attn + moe + 2 * H)
    assert _hf(tmp_path, capsys, cfg) == want == _hf_model_params(cfg)
    path = tmp_path / "config.json"
    c = build_plan(["--hf-config", str(path), "--seq-length", "4096"])[0].config
    assert (c.activation, c.glu_linear_offset, c.activation_func_clamp_value) == (
        "quick_geglu",
        1.0,
        7.0,
    )
    assert (c.softmax_type, tuple(c.window_size), c.window_attn_skip_freq) == (
        "learnable",
        (127, 0),
        2,
    )
    assert (c.position_embedding_type, c.rotary_scaling_factor) == ("yarn", 32.0)


def test_hf_qwen2_moe_layers_and_gated_shared_expert(tmp_path, capsys):
    cfg = {
        **TINY_HF,
        "num_hidden_layers": 3,
        "model_type": "qwen2_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "mlp_only_layers": [1],  # layers 0 and 2 MoE, layer 1 a dense MLP of width 96
    }
    attn = ATTN + (H + 2 * KV) + 2 * H  # + q, k, v biases; two norms
    moe = 4 * H + 4 * 3 * 32 * H + 3 * 48 * H + H  # router, experts, shared, its gate [1, h]
    want = EMBED + 3 * attn + 2 * moe + 3 * F * H
    assert _hf(tmp_path, capsys, cfg) == want == _hf_model_params(cfg)


def test_hf_deepseek_v3_mla_moe_and_mtp(tmp_path, capsys):
    cfg = {
        **TINY_HF,
        "num_hidden_layers": 3,
        "model_type": "deepseek_v3",
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,  # layer 0 dense, layers 1 and 2 MoE
        "q_lora_rank": 24,
        "kv_lora_rank": 20,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "num_nextn_predict_layers": 1,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    plan, _ = build_plan(["--hf-config", str(path)])
    c = plan.config
    assert c.moe_layer_pattern() == [False, True, True] and c.is_moe_layer(4)  # MTP: MoE
    assert (c.num_moe_experts, c.moe_router_topk) == (8, 2)
    assert c.moe_shared_expert_intermediate_size == 2 * 32
    assert (c.multi_latent_attention, c.q_lora_rank, c.kv_lora_rank) == (True, 24, 20)
    assert c.mtp_num_layers == 1
    # MLA by hand: q down + its norm + q up, kv down (latent + RoPE dims) + its norm + kv
    # up, o; 4 heads of 16 + 8 q/k dims and 12 v dims
    heads = 4
    attn = H * 24 + 24 + 24 * heads * 24 + H * (20 + 8) + 20 + 20 * heads * (16 + 12)
    attn += heads * 12 * H + 2 * H  # o, the layer's two norms
    moe = 8 * H + 8 * 3 * 32 * H + 3 * 64 * H
    mtp = 3 * H + 2 * H * H + attn + moe  # enorm, hnorm, final norm, eh_proj, a MoE layer
    want = EMBED + 3 * attn + 3 * F * H + 2 * moe + mtp
    assert sum(s.num_parameters for s in memory_report(plan)) == want


def test_deepseek_v3_preset_totals_are_the_published_ones():
    """The preset at one rank of every kind: 671B parameters (37B activated) as published
    (arXiv 2412.19437), plus the MTP layer; the report's per-stage sum equals the closed
    form over the model (pp4: stages hold 16 + 15 + 15 + 15 layers, the last the MTP
    depth and its copy of the embedding)."""
    import dataclasses

    from pentatron.models import num_parameters

    argv = ["--preset", "deepseek-v3", "--world-size", "4", "--pipeline-model-parallel-size", "4"]
    argv += ["--decoder-first-pipeline-num-layers", "16"]
    plan, _ = build_plan(argv)
    c = plan.config
    total = num_parameters(c, plan.padded_vocab_size)
    no_mtp = dataclasses.replace(c, mtp_num_layers=None)
    assert num_parameters(no_mtp, plan.padded_vocab_size) == pytest.approx(671e9, rel=1e-3)
    active = num_parameters(no_mtp, plan.padded_vocab_size, active=True)
    assert 37e9 <= active < 38e9
    copy = plan.padded_vocab_size * c.hidden_size  # the MTP stage's embedding copy
    assert sum(s.num_parameters for s in memory_report(plan)) == total + copy


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [("gpt-oss-20b", 20.91e9, 3.61e9), ("gpt-oss-120b", 116.83e9, 5.13e9)],
)
def test_gpt_oss_preset_totals_are_the_published_ones(name, total, active):
    """OpenAI's model card: 20.91B / 116.83B parameters, 3.61B / 5.13B active per token
    (without the input embedding: a lookup, not a matmul); sinks, biases and the untied
    head included. The report's per-rank sum at ep8 equals the closed form."""
    from pentatron.models import num_parameters

    plan, _ = build_plan(
        ["--preset", name, "--world-size", "8", "--expert-model-parallel-size", "8"]
    )
    c, vocab = plan.config, plan.padded_vocab_size
    assert vocab == 201088  # divisible by 128 already
    assert num_parameters(c, vocab) == pytest.approx(total, abs=0.005e9)
    embedding = vocab * c.hidden_size
    assert num_parameters(c, vocab, active=True) - embedding == pytest.approx(active, abs=0.005e9)
    (stage,) = memory_report(plan)
    h = f = 2880  # per expert: fc1 [2F, h] + bias [2F], fc2 [h, F] + bias [h]
    experts = c.num_layers * c.num_moe_experts * (2 * f * h + 2 * f + h * f + h)
    assert stage.num_parameters == num_parameters(c, vocab) - experts + experts // 8


def test_hf_sequence_length_is_max_positions_unless_given(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_HF, "model_type": "llama"}))
    plan, _ = build_plan(["--hf-config", str(path)])
    assert plan.seq_length == 32768  # not capped
    assert "max_position_embeddings" in capsys.readouterr().err
    plan, _ = build_plan(["--hf-config", str(path), "--seq-length", "128"])  # = app default
    assert plan.seq_length == 128
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "cfg,needle",
    [
        ({"model_type": "gemma"}, "model_type='gemma'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias=True"),
    ],
)
def test_hf_config_refusals_name_the_key(tmp_path, capsys, cfg, needle):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_HF, **cfg}))
    assert main(["--hf-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "fix:" in err


# --- FP8 weight copies --------------------------------------------------------------------


MOE_EP2 = ["--num-experts", "4", "--moe-ffn-hidden-size", "128"]
MOE_EP2 += ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]


@pytest.mark.parametrize(
    "extra,fc1,fc2",
    [
        ([], 1, True),  # GeLU: fc1 [f/t, h] and fc2 are TE linears
        (["--swiglu"], 2, True),  # SwiGLU's fc1 [2f/t, h] (strided) is a TE module too
        (MOE_EP2, 0, False),  # every layer MoE: the experts are local modules
    ],
)
def test_fp8_weight_cache_is_one_copy_per_te_weight(extra, fc1, fc2, capsys):
    """TE, given is_first_microbatch by the schedule, caches one FP8 copy and its transpose
    of each TE linear's weight: 2 bytes per element, whatever the micro-batches in flight."""
    h, f, t = 256, 512, 2
    argv = [*SMALL, "--num-layers", "4", "--hidden-size", str(h), "--num-attention-heads", "8"]
    argv += ["--ffn-hidden-size", str(f), "--tensor-model-parallel-size", str(t)]
    argv += ["--pipeline-model-parallel-size", "2", "--world-size", "4", "--bf16"]
    argv += ["--global-batch-size", "8", "--fp8-format", "hybrid", "--sequence-parallel"]
    argv += ["--transformer-impl", "transformer_engine", "--json", *extra]
    assert main(argv) == 0
    stages = json.loads(capsys.readouterr().out)
    # per layer and tp rank: qkv [3h/t, h], proj [h, h/t], fc2 [h, f/t], fc1 [f1/t, h]
    per_layer = 3 * h * h // t + h * h // t + fc1 * f * h // t
    per_layer += h * f // t if fc2 else 0
    assert [s["microbatches_in_flight"] for s in stages] == [2, 1]  # 1F1B: min(p - r, m)
    for s in stages:  # 2 layers a stage
        assert s["fp8_weight_cache_bytes"] == 2 * 2 * per_layer
    assert main([a for a in argv if a not in ("hybrid", "--fp8-format")]) == 0
    assert all(s["fp8_weight_cache_bytes"] == 0 for s in json.loads(capsys.readouterr().out))


def test_fp32_gqa_on_cuda_keeps_the_repeated_kv():
    """SDPA's grouped-k/v rule (pentatron.models.sdpa.takes_grouped_kv) with the plan's
    device and dtype: fp32 GQA on CUDA repeats k/v and keeps them at nq heads, `2 e sb nq d`,
    instead of the QKV output `e sb (nq + 2 ng) d` and RoPE's rotated k `e sb ng d`; CPU
    (any dtype) and bf16 on CUDA keep the grouped ones. --device auto sizes a CUDA run."""
    s, b, nq, ng, d = 64, 2, 16, 2, 8
    argv = [
        *SMALL,
        "--num-layers", "1", "--hidden-size", str(nq * d), "--num-attention-heads", str(nq),
        "--group-query-attention", "--num-query-groups", str(ng), "--seq-length", str(s),
        "--micro-batch-size", str(b), "--world-size", "1",
    ]  # fmt: skip

    def attention(*extra):
        plan, _ = build_plan([*argv, *extra])
        return plan.device, chunk_activations(plan, 0, 0).attention

    (cuda, on_cuda), (cpu, on_cpu) = attention("--device", "cuda"), attention("--device", "cpu")
    assert (cuda, cpu, attention()[0]) == ("cuda", "cpu", "cuda")
    assert on_cuda - on_cpu == 4 * s * b * d * (2 * nq - (nq + 2 * ng) - ng)
    assert attention("--device", "cuda", "--bf16")[1] == attention("--device", "cpu", "--bf16")[1]


@pytest.mark.checkout  # examples/ lives in the repository, not in the wheel's test copy
@pytest.mark.parametrize(
    ("name", "world"),
    [
        ("llama3-8b-like.yaml", 64),
        ("mixtral-8x7b-like.yaml", 64),
        ("deepseek-v3-like.yaml", 8),
        ("gpt-oss-20b-like.yaml", 8),
    ],
)
def test_example_configs_fit_the_gpus_they_are_written_for(name, world, capsys):
    """The cluster example configs (written for 80 GB H100s) size at their world and fit:
    every stage's total under 80 GB (deepseek-v3-like with its mla_up_proj recompute)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "examples" / "configs" / name
    assert main(["--config", str(path), "--world-size", str(world), "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)
    assert stages and all(0 < s["total_bytes"] < 80e9 for s in stages)
