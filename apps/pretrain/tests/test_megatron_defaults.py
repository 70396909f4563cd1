"""Every flag we share with Megatron-LM has Megatron-LM's default; what cannot hold here is
said once at start-up; what Megatron requires, we require.

`megatron_defaults.json` is data copied once from Megatron-LM's parser (its "source" names
the commit): all 838 flags, each with the default of the value it sets (a `--no-x` switch:
the default of `x`). Enum defaults are stored as Megatron prints them (`<AttnBackend.auto:
5>`) and compared by member name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pentatron.pretrain.arguments import ArgumentError, build_parser, parse_args, validate_args

TABLE = json.loads((Path(__file__).parent / "megatron_defaults.json").read_text())
MEGATRON_DEFAULTS: dict[str, object] = TABLE["defaults"]

# A run needs these and Megatron-LM gives them no default: the smallest valid set.
REQUIRED = {
    "--num-layers": "2",
    "--hidden-size": "32",
    "--num-attention-heads": "4",
    "--seq-length": "16",
    "--max-position-embeddings": "16",
    "--micro-batch-size": "1",
    "--lr": "1e-3",
}


def _megatron_value(value: object) -> object:
    if isinstance(value, str):
        enum = re.fullmatch(r"<\w+\.(\w+): \d+>", value)
        if enum:
            return enum.group(1)
    return value


def _shared() -> dict[str, tuple[object, object]]:
    """flag -> (our default, Megatron-LM's) for every flag both parsers have."""
    out = {}
    for action in build_parser()._actions:
        for flag in action.option_strings:
            if flag in MEGATRON_DEFAULTS:
                out[flag] = (action.default, _megatron_value(MEGATRON_DEFAULTS[flag]))
    return out


def test_table_is_megatrons_whole_parser():
    assert "d98e8a64ddf34856e74b24714e3bedb2f5a39553" in TABLE["source"]
    assert len(MEGATRON_DEFAULTS) == 838
    # the defaults the issue found different: Megatron's values, read from the table
    assert MEGATRON_DEFAULTS["--position-embedding-type"] == "learned_absolute"
    assert MEGATRON_DEFAULTS["--normalization"] == "LayerNorm"
    assert MEGATRON_DEFAULTS["--hidden-dropout"] == MEGATRON_DEFAULTS["--attention-dropout"] == 0.1
    assert MEGATRON_DEFAULTS["--adam-beta2"] == 0.999
    assert MEGATRON_DEFAULTS["--num-workers"] == 2
    assert MEGATRON_DEFAULTS["--transformer-impl"] == "transformer_engine"


def test_every_shared_flag_has_megatrons_default():
    shared = _shared()
    assert len(shared) > 200  # the model, parallel, optimizer, data, logging flags at least
    wrong = {flag: pair for flag, pair in shared.items() if pair[0] != pair[1]}
    assert not wrong, "flag: (ours, Megatron-LM's): " + repr(wrong)


def _argv(**drop: bool) -> list[str]:
    argv = ["--train-iters", "2", "--mock-data"]
    for flag, value in REQUIRED.items():
        if not drop.get(flag[2:].replace("-", "_")):
            argv += [flag, value]
    return argv


@pytest.mark.parametrize("flag", sorted(REQUIRED))
def test_flag_megatron_gives_no_default_is_required(flag):
    args = parse_args(_argv(**{flag[2:].replace("-", "_"): True}))
    with pytest.raises(ArgumentError, match=rf"^{flag}=None: required .*; fix: pass e\.g\. {flag}"):
        validate_args(args, 1)


def test_defaults_build_megatrons_gpt():
    """Only the required flags: the model Megatron-LM builds from them (LayerNorm, learned
    positions, dropout 0.1, GELU 4h MLP with biases, tied embeddings), Adam(0.9, 0.999) with
    a linear decay; on this CPU machine the transformer-engine default is said, once."""
    from pentatron.pretrain.training.configs import transformer_config

    args = validate_args(parse_args(_argv()), 1)
    config = transformer_config(args)
    assert config.normalization == "LayerNorm"
    assert args.position_embedding_type == "learned_absolute"
    assert config.hidden_dropout == config.attention_dropout == 0.1
    assert config.add_bias_linear and config.ffn_hidden_size == 4 * 32
    assert (args.adam_beta1, args.adam_beta2, args.lr_decay_style) == (0.9, 0.999, "linear")
    assert (args.num_workers, args.log_interval, args.eval_iters) == (2, 100, 100)
    assert args.eval_interval is None
    notes = [n for n in args.startup_notes if "--transformer-impl" in n]
    assert len(notes) == 1 and "local PyTorch spec runs" in notes[0]
    assert args.transformer_impl == "local"
    quiet = validate_args(parse_args([*_argv(), "--transformer-impl", "local"]), 1)
    assert not [n for n in quiet.startup_notes if "--transformer-impl" in n]


@pytest.mark.parametrize(("hidden", "ffn"), [(4096, 10880), (2048, 5440), (96, 256)])
def test_swiglu_ffn_default_is_megatrons_rounding(hidden, ffn):
    # Megatron: int((4 * h * 2 / 3) / 64) * 64, i.e. rounded down (4096 -> 10880, not 10944)
    argv = [*_argv(), "--swiglu", "--hidden-size", str(hidden), "--num-attention-heads", "32"]
    assert validate_args(parse_args(argv), 1).ffn_hidden_size == ffn


def test_the_shipped_flag_names_are_megatrons():
    """The parser's list of Megatron-LM's flags (for its messages) is this table's."""
    from pentatron.pretrain.megatron_flags import MEGATRON_FLAGS

    assert set(MEGATRON_FLAGS) == set(MEGATRON_DEFAULTS)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--tp-comm-overlap"], "--tp-comm-overlap: a Megatron-LM flag this release does not"),
        (["--tp-comm-overlap-cfg", "x.yaml"], "--tp-comm-overlap-cfg: a Megatron-LM flag"),
        (["--deterministic-mode"], "--deterministic-mode: a Megatron-LM flag"),
        (
            ["--pipeline-model-paralel-size", "2"],
            "not a flag of pentatron-pretrain or Megatron-LM; fix: did you mean "
            "--pipeline-model-parallel-size",
        ),
        (["--num-layers", "2", "3"], "unexpected argument '3': pentatron-pretrain takes flags"),
    ],
)
def test_a_flag_we_do_not_take_is_refused_in_one_line(argv, needle):
    with pytest.raises(ArgumentError) as e:
        parse_args(argv)
    assert needle in str(e.value) and "fix:" in str(e.value)


def test_every_megatron_flag_is_taken_or_refused_as_megatrons():
    """A Megatron-LM launch script's flag is either read (it parses) or refused naming it
    as Megatron's: never argparse's bare "unrecognized arguments"."""
    ours = {o for a in build_parser()._actions for o in a.option_strings}
    for flag in sorted(set(MEGATRON_DEFAULTS) - ours):
        with pytest.raises(ArgumentError, match=f"^{re.escape(flag)}: a Megatron-LM flag"):
            parse_args([flag])


def test_a_config_key_megatron_has_and_we_lack_is_named(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("num-layers: 2\ntp-comm-overlap: true\n")
    with pytest.raises(ArgumentError, match="unknown key 'tp-comm-overlap'; a Megatron-LM flag"):
        parse_args(["--config", str(config)])
