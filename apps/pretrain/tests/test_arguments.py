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
]


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
        (["--data-path", "/nonexistent/corpus"], 1, "--data-path"),
        (["--train-samples", "100"], 1, "--train-iters"),  # both given
        (["--fp16", "--bf16"], 1, "--fp16"),
        (["--enable-cuda-graph"], 1, "--enable-cuda-graph"),  # CPU
        (["--fp8-format", "hybrid"], 1, "--fp8-format"),
        (["--num-experts", "4"], 1, "--num-experts"),
        (["--save-interval", "5"], 1, "--save-interval"),  # without --save
        (["--async-save", "--save", "/tmp/x"], 1, "--async-save"),  # not in this release
        (["--device", "cuda"], 1, "--device"),  # this machine has no GPU
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


@pytest.mark.parametrize(
    ("name", "world"), [("quickstart-cpu.yaml", 8), ("llama3-8b-like.yaml", 64)]
)
def test_example_configs_validate(name, world):
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "examples" / "configs" / name
    if not path.is_file():
        pytest.skip("examples/ lives in the repository, not in the wheel's test copy")
    cuda = "llama" in name  # a GPU run: validated as on a CUDA machine
    args = validate_args(parse_args(["--config", str(path), "--mock-data"]), world, cuda=cuda)
    assert (
        args.data_parallel_size
        * args.tensor_model_parallel_size
        * (args.pipeline_model_parallel_size)
        == world
    )
    assert args.num_microbatches >= args.pipeline_model_parallel_size
