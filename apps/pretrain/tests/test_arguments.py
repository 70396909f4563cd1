"""Arguments: Megatron flag names, --config YAML (flags win), and one-line errors naming the
flag for every layout that cannot work, raised before any process group exists."""

from __future__ import annotations

import pytest

from pentatron.pretrain.arguments import ArgumentError, parse_args, validate_args

BASE = [
    "--train-iters",
    "10",
    "--num-layers",
    "8",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "8",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--max-position-embeddings",
    "32",
    "--lr",
    "1e-3",
]


ZBV = ["--pipeline-schedule", "zbv", "--untie-embeddings-and-output-weights"]
ZBV2 = ["--pipeline-model-parallel-size", "2", *ZBV]


def _validated(extra, world=8):
    return validate_args(parse_args(BASE + extra), world)


def test_derived_values_for_the_readme_layout():
    args = _validated(
        [
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "2",
            "--sequence-parallel",
            "--global-batch-size",
            "16",
            "--use-distributed-optimizer",
        ]
    )
    assert args.data_parallel_size == 8 // (2 * 2)
    assert args.virtual_pipeline_model_parallel_size == 8 // (2 * 2)
    assert args.num_microbatches == 16 // (2 * 2)
    assert args.sequence_parallel and args.use_distributed_optimizer
    assert args.max_position_embeddings == 32 and args.lr_decay_iters == 10


@pytest.mark.parametrize(
    ("extra", "world", "flag"),
    [
        (["--global-batch-size", "6"], 2, "--global-batch-size"),  # 6 % (2 mbs * 2 dp)
        (["--tensor-model-parallel-size", "3"], 3, "--num-attention-heads"),  # 8 heads
        (["--tensor-model-parallel-size", "3"], 8, "--tensor-model-parallel-size"),  # world
        (["--pipeline-model-parallel-size", "3"], 3, "--num-layers"),  # 8 layers / 3
        (
            ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
            2,
            "--num-layers-per-virtual-pipeline-stage",
        ),
        (["--pipeline-schedule", "zb-h1"], 1, "--pipeline-schedule"),  # pp 1
        (  # ZBV: tied embeddings (the default) would sit in both chunks of rank 0
            ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv"],
            2,
            "--untie-embeddings-and-output-weights",
        ),
        (  # 12 layers split over 4 ranks, not over the V's 2 x 4 stages
            [*ZBV, "--pipeline-model-parallel-size", "4", "--num-layers", "12"],
            4,
            "--num-layers",
        ),
        (
            [*ZBV2, "--virtual-pipeline-model-parallel-size", "2", "--global-batch-size", "8"],
            2,
            "--virtual-pipeline-model-parallel-size",
        ),
        (
            [*ZBV2, "--decoder-first-pipeline-num-layers", "2"],
            2,
            "--decoder-first-pipeline-num-layers",
        ),
        ([*ZBV2, "--mtp-num-layers", "1"], 2, "--mtp-num-layers"),
        ([*ZBV2, "--use-torch-fsdp2"], 4, "--use-torch-fsdp2"),
        (
            ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved"],
            2,
            "--pipeline-schedule",
        ),  # no virtual stages
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "2",
                "--global-batch-size",
                "8",
                "--pipeline-schedule",
                "zb-h1",
            ],
            2,
            "--pipeline-schedule",
        ),
        (
            [
                "--pipeline-model-parallel-size",
                "2",
                "--pipeline-schedule",
                "zb-h1",
                "--use-torch-fsdp2",
            ],
            4,
            "--use-torch-fsdp2",
        ),
        (
            ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1", "--compile"],
            2,
            "--compile",
        ),
        (["--data-path", "/nonexistent/corpus"], 1, "--data-path"),
        (["--train-samples", "100"], 1, "--train-iters"),  # both given
        (["--fp16", "--bf16"], 1, "--fp16"),
        (["--enable-cuda-graph"], 1, "--enable-cuda-graph"),  # CPU
        (["--fp8-format", "hybrid"], 1, "--fp8-format"),
        (["--num-experts", "6", "--expert-model-parallel-size", "4"], 4, "--num-experts"),
        (["--num-experts", "4", "--moe-router-topk", "5"], 1, "--moe-router-topk"),
        (
            ["--num-experts", "4", "--expert-model-parallel-size", "3"],
            4,
            "--expert-model-parallel-size",
        ),
        (["--save-interval", "5"], 1, "--save-interval"),  # without --save
        (["--async-save"], 1, "--async-save"),  # without --save
        (["--device", "cuda"], 1, "--device"),  # this machine has no GPU
        (
            ["--use-torch-fsdp2", "--use-distributed-optimizer"],
            2,
            "--use-distributed-optimizer",
        ),
        (  # FSDP2 cuts experts over the mesh of edp ranks; their etp must be tp
            [
                *("--use-torch-fsdp2", "--num-experts", "4"),
                *("--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"),
            ],
            4,
            "--expert-tensor-parallel-size",
        ),
        (
            [
                "--sequence-parallel",
                "--tensor-model-parallel-size",
                "2",
                "--seq-length",
                "33",
                "--max-position-embeddings",
                "64",
            ],
            2,
            "--seq-length",
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(extra, world, flag):
    with pytest.raises(ArgumentError) as info:
        _validated(extra, world)
    message = str(info.value)
    assert message.startswith(flag + "=") and "\n" not in message and "fix:" in message


def test_yaml_config_uses_flag_names_and_flags_override(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "tensor-model-parallel-size: 2\nglobal_batch_size: 8\nlr: 1.0e-3\nswiglu: true\n"
        "data-path: []\n"
    )
    args = validate_args(parse_args([*BASE, "--config", str(cfg), "--lr", "2e-3"]), 4)
    assert args.tensor_model_parallel_size == 2 and args.global_batch_size == 8
    assert args.swiglu and args.lr == 2e-3  # the flag wins over the file


def test_yaml_unknown_key_is_named(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("tensor-model-paralel-size: 2\n")
    with pytest.raises(ArgumentError, match="tensor-model-paralel-size"):
        parse_args(["--config", str(cfg)])


def test_main_reports_bad_flags_and_exits_2(capsys, monkeypatch):
    from pentatron.pretrain.pretrain_gpt import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main([*BASE, "--global-batch-size", "6"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pentatron-pretrain: error: --global-batch-size=6")


@pytest.mark.checkout  # examples/ lives in the repository, not in the wheel's test copy
@pytest.mark.parametrize(
    ("name", "world"),
    [
        ("quickstart-cpu.yaml", 8),
        ("llama3-8b-like.yaml", 64),
        ("mixtral-8x7b-like.yaml", 64),
        ("deepseek-v3-like.yaml", 8),
        ("gpt-oss-20b-like.yaml", 8),
    ],
)
def test_example_configs_validate_at_their_world_size(name, world):
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "examples" / "configs" / name
    cuda = world > 8  # the cluster configs: validated as on a CUDA machine
    args = validate_args(parse_args(["--config", str(path), "--mock-data"]), world, cuda=cuda)
    assert (
        args.data_parallel_size
        * args.tensor_model_parallel_size
        * (args.pipeline_model_parallel_size)
        == world
    )
    assert args.num_microbatches >= args.pipeline_model_parallel_size


@pytest.mark.parametrize(
    ("text", "want"),
    [("2", 2), ("0,1,1", [0, 1, 1]), ("[0,1]*2", [0, 1, 0, 1]), ("[0]*1+[1]*3", [0, 1, 1, 1])],
)
def test_moe_layer_freq_patterns_are_parsed_not_evaluated(text, want):
    from pentatron.pretrain.arguments import parse_moe_layer_freq

    assert parse_moe_layer_freq(text) == want


def test_moe_layer_freq_rejects_code():
    import argparse

    from pentatron.pretrain.arguments import parse_moe_layer_freq

    with pytest.raises(argparse.ArgumentTypeError, match="moe-layer-freq"):
        parse_moe_layer_freq("__import__('os').getcwd()")


def test_moe_flags_reach_the_model_and_parallel_configs():
    from pentatron.pretrain.training import configs

    args = _validated(
        [
            "--num-experts",
            "4",
            "--moe-router-topk",
            "1",
            "--expert-model-parallel-size",
            "2",
            "--moe-layer-freq",
            "[0]*1+[1]*7",
            "--moe-token-dispatcher-type",
            "alltoall",
            "--moe-aux-loss-coeff",
            "0.01",
        ],
        2,
    )
    model = configs.transformer_config(args)
    assert (model.num_moe_experts, model.moe_router_topk) == (4, 1)
    assert model.moe_layer_pattern() == [False] + [True] * 7
    assert model.moe_token_dispatcher_type == "alltoall" and model.moe_aux_loss_coeff == 0.01
    assert configs.parallel_config(args).ep == 2


@pytest.mark.parametrize(
    "flags, fused",
    [(["--swiglu"], True), (["--swiglu", "--no-bias-swiglu-fusion"], False), ([], False)],
)
def test_swiglu_fusion_follows_megatron_flags(flags, fused):
    """Megatron's --no-bias-swiglu-fusion: fused SwiGLU by default, never for GeLU."""
    from pentatron.pretrain.training import configs

    model = configs.transformer_config(_validated(flags, 1))
    assert model.bias_activation_fusion is fused


def test_fp8_recipe_and_wgrad_fusion_flags_reach_the_model_config():
    """--fp8-margin / --fp8-amax-history-len / --fp8-amax-compute-algo (Megatron's recipe
    knobs, the Llama-3 FP8 script's 1024 / max) and --no-gradient-accumulation-fusion end up
    in the TransformerConfig that builds the layers and the DelayedScaling recipe."""
    from pentatron.models.te_spec import fp8_recipe_kwargs
    from pentatron.pretrain.training import configs

    default = configs.transformer_config(_validated([], 1))
    assert default.gradient_accumulation_fusion is True
    assert fp8_recipe_kwargs(default) == {
        "margin": 0,
        "amax_history_len": 1,
        "amax_compute_algo": "most_recent",
    }
    flags = ["--fp8-margin", "2", "--fp8-amax-history-len", "1024"]
    flags += ["--fp8-amax-compute-algo", "max", "--no-gradient-accumulation-fusion"]
    model = configs.transformer_config(_validated(flags, 1))
    assert model.gradient_accumulation_fusion is False
    assert fp8_recipe_kwargs(model) == {
        "margin": 2,
        "amax_history_len": 1024,
        "amax_compute_algo": "max",
    }


def test_pipeline_schedule_default_and_transformer_engine():
    pp2 = ["--pipeline-model-parallel-size", "2"]
    assert _validated(pp2, 2).pipeline_schedule is None  # Megatron's pick: 1F1B here
    assert _validated([*pp2, "--pipeline-schedule", "zb-h1"], 2).pipeline_schedule == "zb-h1"
    zbv = _validated([*pp2, *ZBV], 2)  # built as two chunks per rank, in a V
    assert (zbv.pipeline_schedule, zbv.virtual_pipeline_model_parallel_size) == ("zbv", 2)
    # Fewer micro-batches than stages: ZBV's table allows it (interleaving does not).
    assert _validated([*pp2, *ZBV, "--global-batch-size", "2"], 2).num_microbatches == 1
    te = [*pp2, "--pipeline-schedule", "zb-h1", "--transformer-impl", "transformer_engine"]
    with pytest.raises(ArgumentError, match=r"^--transformer-impl=transformer_engine: .*zb-h1"):
        validate_args(parse_args(BASE + te), 2, cuda=True, have_te=True)


@pytest.mark.parametrize(
    "extra, checked",
    [
        ([], True),
        (["--fp16"], False),  # dynamic loss scaling: an overflow skips the step (Megatron)
        (["--fp16", "--loss-scale", "1024"], True),  # a constant scale cannot back off
        (["--fp16", "--no-check-for-nan-in-loss-and-grad"], False),
        (["--bf16"], True),
    ],
)
def test_fp16_runs_on_cpu_and_dynamic_scaling_turns_the_grad_check_off(extra, checked):
    args = validate_args(parse_args(BASE + extra), 1, cuda=False)
    assert args.check_for_nan_in_loss_and_grad is checked
    noted = any("dynamic loss scaling" in n for n in args.startup_notes)
    assert noted == (extra == ["--fp16"])  # said once, where the rule changed the flag


def test_context_parallel_on_a_te_machine_runs_the_local_spec():
    """With transformer-engine and CUDA, --context-parallel-size 2 under Megatron's default
    --transformer-impl runs the local spec (whose attention runs over the cp group), said
    once; GPTModel would refuse the TE layout only after the groups exist. FP8 (TE only)
    with cp is refused by name."""
    cp = ["--context-parallel-size", "2", "--attention-dropout", "0"]
    args = validate_args(parse_args(BASE + cp), 2, cuda=True, have_te=True)
    assert args.transformer_impl == "local"
    notes = [n for n in args.startup_notes if "--context-parallel-size" in n]
    assert len(notes) == 1 and "local PyTorch spec" in notes[0]
    te = validate_args(parse_args(BASE), 2, cuda=True, have_te=True)
    assert te.transformer_impl == "transformer_engine"  # without cp: TE's layout
    quiet = validate_args(parse_args([*BASE, *cp, "--transformer-impl", "local"]), 2, cuda=True)
    assert not [n for n in quiet.startup_notes if "--context-parallel-size" in n]
    fp8 = [*cp, "--bf16", "--fp8-format", "hybrid"]
    with pytest.raises(ArgumentError, match=r"^--fp8-format=hybrid: .*context-parallel"):
        validate_args(parse_args(BASE + fp8), 2, cuda=True, have_te=True)
