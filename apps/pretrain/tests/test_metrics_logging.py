"""TrainingLogger (console line, JSONL, TensorBoard) and the pentatron-plot CLI.

Expected values are computed here from the inputs passed, never copied from the logger.
"""

from __future__ import annotations

import io
import json
import math
import re
import sys

import pytest

from pentatron.pretrain.metrics import TrainingLogger, tflops_per_device
from pentatron.pretrain.metrics.console import format_train_line

ANSI = re.compile(r"\x1b\[")


def _iteration(loss, *, lr=1e-3, grad_norm=1.0, skipped=0, elapsed=0.5, scale=1.0):
    return {
        "lm loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "loss_scale": scale,
        "num_zeros": None,
        "skipped": skipped,
        "elapsed_s": elapsed,
    }


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _logger(tmp_path, stream=None, **kwargs):
    defaults = dict(
        log_interval=4,
        train_iters=8,
        jsonl_path=str(tmp_path / "metrics.jsonl"),
        tensorboard_dir=None,
        enabled=True,
        progress=False,
        console=stream if stream is not None else io.StringIO(),
    )
    defaults.update(kwargs)
    return TrainingLogger(**defaults)


def test_jsonl_aggregates_one_record_per_interval(tmp_path):
    losses = [4.0, 3.5, 3.25, 3.0, 2.9, 2.7, 2.6, 2.5]
    times = [1.0, 0.5, 0.25, 0.25, 0.2, 0.4, 0.3, 0.1]
    lrs = [1e-4 * (i + 1) for i in range(8)]
    tokens, gbs, flops = 4096, 8, 2.0e12
    stream = io.StringIO()
    logger = _logger(
        tmp_path,
        stream,
        tokens_per_iteration=tokens,
        global_batch_size=gbs,
        flops_per_iteration=flops,
        world_size=2,
    )
    for i in range(8):
        logger.log_train(i + 1, _iteration(losses[i], lr=lrs[i], elapsed=times[i], grad_norm=i))
    logger.close()

    records = _read(tmp_path / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [4, 8]
    for r, lo in zip(records, (0, 4)):
        mean_time = sum(times[lo : lo + 4]) / 4
        assert r["split"] == "train"
        assert r["lm_loss"] == pytest.approx(sum(losses[lo : lo + 4]) / 4)
        assert r["iteration_time_s"] == pytest.approx(mean_time)
        assert r["lr"] == pytest.approx(lrs[lo + 3])  # the last iteration's, as Megatron
        assert r["grad_norm"] == lo + 3
        assert r["num_zeros"] is None
        assert r["skipped_iterations"] == 0 and r["nan_iterations"] == 0
        assert r["consumed_samples"] == r["iteration"] * gbs
        assert r["consumed_tokens"] == r["iteration"] * tokens
        assert r["tokens_per_s"] == pytest.approx(tokens / mean_time)
        assert r["tflops_per_device"] == pytest.approx(flops / mean_time / 2 / 1e12)
        assert r["eta_s"] == pytest.approx(mean_time * (8 - r["iteration"]))
        assert r["memory_bytes"] > 0  # max RSS on a CPU run

    text = stream.getvalue()
    assert not ANSI.search(text)  # not a terminal: plain lines
    lines = [line for line in text.splitlines() if "iteration" in line]
    assert len(lines) == 2
    assert lines[0].startswith(" iteration 4/8 | consumed samples: ")
    for field in (
        "elapsed time per iteration (ms): 500.0",
        "tokens/s: 8192",
        f"TFLOP/s/device: {flops / 0.5 / 2 / 1e12:.1f}",
        "learning rate: 4.000000E-04",
        "global batch size:     8",
        f"lm loss: {sum(losses[:4]) / 4:.6E}",
        "loss scale: 1.0",
        "grad norm: 3.000",
        "number of skipped iterations:   0",
        "number of nan iterations:   0",
        "ETA 0:00:02",
    ):
        assert field in lines[0], field


def test_skipped_and_nan_iterations_are_counted_and_left_out_of_the_mean(tmp_path):
    logger = _logger(tmp_path, log_interval=5, train_iters=10)
    steps = [
        _iteration(2.0),
        _iteration(float("nan"), skipped=1),
        _iteration(3.0, skipped=1),  # skipped: not in the mean
        _iteration(float("inf")),
        _iteration(5.0),
    ]
    for i, metrics in enumerate(steps):
        logger.log_train(i + 1, metrics)
    for i in range(5, 10):  # an interval where every loss is NaN
        logger.log_train(i + 1, _iteration(float("nan"), skipped=1))
    logger.close()
    first, second = _read(tmp_path / "metrics.jsonl")
    assert first["lm_loss"] == pytest.approx((2.0 + 5.0) / 2)
    assert first["skipped_iterations"] == 2
    assert first["nan_iterations"] == 2
    assert second["lm_loss"] is None  # strict JSON: no NaN token
    assert second["skipped_iterations"] == 5 and second["nan_iterations"] == 5
    assert "NaN" not in (tmp_path / "metrics.jsonl").read_text()


def test_batch_size_ramp_up_and_the_loops_own_nan_flag(tmp_path):
    # what training/loop.py passes: consumed_samples, this iteration's batch, a nan flag
    seq, full_batch, flops_full = 16, 8, 4.0e12
    batches, times = [2, 4, 6, 8], [0.1, 0.2, 0.3, 0.4]
    logger = _logger(
        tmp_path,
        log_interval=4,
        train_iters=4,
        seq_length=seq,
        global_batch_size=full_batch,
        flops_per_iteration=flops_full,
    )
    consumed = 0
    for i, (batch, dt) in enumerate(zip(batches, times)):
        consumed += batch
        metrics = _iteration(1.0, elapsed=dt) | {
            "global_batch_size": batch,
            "consumed_samples": consumed,
            "nan": int(i == 2),
            "skipped": int(i == 2),
        }
        logger.log_train(i + 1, metrics)
    logger.close()
    (record,) = _read(tmp_path / "metrics.jsonl")
    assert record["consumed_samples"] == sum(batches)
    assert record["consumed_tokens"] == sum(batches) * seq
    assert record["global_batch_size"] == 8
    assert record["nan_iterations"] == 1 and record["skipped_iterations"] == 1
    assert record["tokens_per_s"] == pytest.approx(sum(b * seq for b in batches) / sum(times))
    flops = sum(flops_full * b / full_batch for b in batches)
    assert record["tflops_per_device"] == pytest.approx(flops / sum(times) / 1 / 1e12)


def test_partial_last_interval_is_written_at_train_iters(tmp_path):
    logger = _logger(tmp_path, log_interval=4, train_iters=6)
    for i in range(6):
        logger.log_train(i + 1, _iteration(float(i)))
    logger.close()
    records = _read(tmp_path / "metrics.jsonl")
    assert [r["iteration"] for r in records] == [4, 6]
    assert records[1]["lm_loss"] == pytest.approx((4.0 + 5.0) / 2)
    assert records[1]["iterations_in_interval"] == 2


def test_a_resumed_run_appends(tmp_path):
    first = _logger(tmp_path, log_interval=2, train_iters=8)
    for i in range(4):
        first.log_train(i + 1, _iteration(1.0))
    first.close()
    second = _logger(tmp_path, log_interval=2, train_iters=8)
    for i in range(4, 8):
        second.log_train(i + 1, _iteration(2.0))
    second.log_eval(8, {"lm loss": 2.5})
    second.close()
    records = _read(tmp_path / "metrics.jsonl")
    assert [(r["iteration"], r["split"]) for r in records] == [
        (2, "train"),
        (4, "train"),
        (6, "train"),
        (8, "train"),
        (8, "valid"),
    ]


def test_eval_record_and_lines(tmp_path):
    stream = io.StringIO()
    logger = _logger(tmp_path, stream)
    logger.log_eval(4, {"lm loss": 3.0})
    logger.close()
    (record,) = _read(tmp_path / "metrics.jsonl")
    assert record["split"] == "valid"
    assert record["lm_loss"] == 3.0
    assert record["ppl"] == pytest.approx(math.exp(3.0))
    rule, line, rule2 = stream.getvalue().splitlines()
    assert rule == rule2 == "-" * (len(line) + 1)
    assert "validation loss at iteration 4 | lm loss value: 3.000000E+00 |" in line
    assert f"lm loss PPL: {math.exp(3.0):.6E}" in line


def test_a_disabled_logger_writes_nothing(tmp_path):
    stream = io.StringIO()
    logger = _logger(
        tmp_path, stream, enabled=False, tensorboard_dir=str(tmp_path / "tb"), progress=True
    )
    for i in range(8):
        logger.log_train(i + 1, _iteration(1.0))
    logger.log_eval(8, {"lm loss": 1.0})
    logger.close()
    assert list(tmp_path.iterdir()) == []
    assert stream.getvalue() == ""


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    logger = _logger(
        tmp_path,
        tensorboard_dir=str(tb),
        log_interval=2,
        train_iters=4,
        tokens_per_iteration=1000,
        flops_per_iteration=1e12,
        global_batch_size=4,
    )
    losses = [3.0, 2.0, 1.5, 1.0]
    for i, loss in enumerate(losses):
        logger.log_train(i + 1, _iteration(loss, lr=0.1 * (i + 1), elapsed=0.5))
    logger.log_eval(4, {"lm loss": 1.25})
    logger.close()
    assert any(p.name.startswith("events.out.tfevents") for p in tb.iterdir())

    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in (
        "lm loss",
        "learning-rate",
        "grad-norm",
        "loss-scale",
        "iteration-time",
        "throughput/tokens_per_s",
        "throughput/tflops_per_device",
        "lm loss vs samples",
        "lm loss validation",
        "lm loss validation ppl",
    ):
        assert tag in tags, tag

    def scalars(tag):
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    assert scalars("lm loss") == [(2, pytest.approx(2.5)), (4, pytest.approx(1.25))]
    assert scalars("lm loss vs samples") == [(8, pytest.approx(2.5)), (16, pytest.approx(1.25))]
    assert scalars("learning-rate") == [(2, pytest.approx(0.2)), (4, pytest.approx(0.4))]
    assert scalars("throughput/tokens_per_s") == [(2, 2000.0), (4, 2000.0)]
    assert scalars("throughput/tflops_per_device") == [(2, 2.0), (4, 2.0)]
    assert scalars("lm loss validation ppl") == [(4, pytest.approx(math.exp(1.25)))]


def test_tflops_per_device_matches_a_hand_count_of_the_gemms(tmp_path):
    from pentatron.models.config import TransformerConfig
    from pentatron.models.counting import num_floating_point_operations

    L, h, heads, s, V, b = 2, 64, 4, 32, 128, 8
    config = TransformerConfig(num_layers=L, hidden_size=h, num_attention_heads=heads)
    # forward FLOPs, 2 per multiply-add: QKV (h -> 3h), scores and values (2 x s^2 h, of
    # which the causal mask keeps half, as Megatron counts them), output projection (h -> h),
    # MLP (h -> 4h -> h), logits (h -> V); backward = 2x forward.
    causal_pairs = s * s // 2
    per_layer = (
        2 * s * h * 3 * h + 2 * (2 * causal_pairs * h) + 2 * s * h * h + 2 * (2 * s * h * 4 * h)
    )
    forward = b * (L * per_layer + 2 * s * h * V)
    hand = 3 * forward
    flops = num_floating_point_operations(config, s, V, batch_size=b)
    assert flops == pytest.approx(hand)

    dt, world = 0.25, 4
    assert tflops_per_device(hand, dt, world) == pytest.approx(hand / dt / world / 1e12)
    logger = _logger(
        tmp_path, log_interval=1, train_iters=1, flops_per_iteration=flops, world_size=4
    )
    logger.log_train(1, _iteration(1.0, elapsed=dt))
    logger.close()
    (record,) = _read(tmp_path / "metrics.jsonl")
    assert record["tflops_per_device"] == pytest.approx(hand / dt / world / 1e12)


def test_line_leaves_out_what_was_not_measured():
    record = {
        "iteration": 3,
        "lm_loss": 1.0,
        "skipped_iterations": 0,
        "nan_iterations": 0,
        "grad_norm": None,
    }
    line = format_train_line(record, 100)
    assert line == (
        " iteration   3/100 | lm loss: 1.000000E+00 | number of skipped iterations:   0 |"
        " number of nan iterations:   0 |"
    )


def test_progress_bar_on_a_terminal(tmp_path):
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200)
    logger = _logger(tmp_path, console=console, progress=True, tokens_per_iteration=100)
    for i in range(8):
        logger.log_train(i + 1, _iteration(1.0))
    logger.close()
    text = out.getvalue()
    assert "iteration" in text and "8/8" in text
    assert len(_read(tmp_path / "metrics.jsonl")) == 2


def _write_run(tmp_path, name="run"):
    run = tmp_path / name
    logger = _logger(
        run, log_interval=2, train_iters=10, tokens_per_iteration=512, global_batch_size=2
    )
    for i in range(10):
        logger.log_train(i + 1, _iteration(5.0 / (i + 1), elapsed=0.1 + 0.01 * i))
        if (i + 1) % 5 == 0:
            logger.log_eval(i + 1, {"lm loss": 6.0 / (i + 1)})
    logger.close()
    return run / "metrics.jsonl"


@pytest.mark.parametrize("x", ["iteration", "tokens"])
def test_plot_cli_writes_a_png(tmp_path, x, capsys):
    pytest.importorskip("matplotlib")
    from pentatron.pretrain.plot import main

    first, second = _write_run(tmp_path, "a"), _write_run(tmp_path, "b")
    with open(first, "a") as f:
        f.write('{"iteration": 1')  # a line cut short by a killed run
    out = tmp_path / "plots" / "loss.png"
    assert main([str(first), str(second), "--out", str(out), "--x", x]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_plot_cli_without_matplotlib_prints_an_install_hint(tmp_path, monkeypatch, capsys):
    from pentatron.pretrain.plot import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert main([str(tmp_path / "metrics.jsonl")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install" in err[0]


@pytest.mark.parametrize("per_layer", [False, True], ids=["aggregate", "per-layer"])
def test_moe_aux_losses_are_averaged_per_layer_over_the_interval(tmp_path, per_layer):
    """--moe-per-layer-logging adds Megatron's `moe/<name>_layer_<i>` (from 0) scalars."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb, stream = tmp_path / "tb", io.StringIO()
    logger = _logger(
        tmp_path,
        stream,
        tensorboard_dir=str(tb),
        log_interval=2,
        train_iters=2,
        moe_per_layer_logging=per_layer,
    )
    # layer 1 dense (0), layers 2 and 3 MoE
    per_step = [[0.0, 1.0, 3.0], [0.0, 2.0, 5.0]]
    for i, layers in enumerate(per_step):
        metrics = _iteration(2.0)
        metrics["moe_losses"] = {"load_balancing_loss": layers, "z_loss": [0.0, 0.5, 0.5]}
        logger.log_train(i + 1, metrics)
    logger.close()
    (record,) = _read(tmp_path / "metrics.jsonl")
    assert record["moe_load_balancing_loss_per_layer"] == [0.0, 1.5, 4.0]
    assert record["moe_load_balancing_loss"] == pytest.approx((1.5 + 4.0) / 2)
    assert record["moe_z_loss"] == pytest.approx(0.5)
    assert "load_balancing_loss: 2.750000E+00" in stream.getvalue()
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert [e.value for e in acc.Scalars("load_balancing_loss")] == [pytest.approx(2.75)]
    per_layer_tags = sorted(t for t in acc.Tags()["scalars"] if t.startswith("moe/"))
    if not per_layer:
        assert per_layer_tags == []
        return
    assert per_layer_tags == [
        f"moe/{n}_layer_{i}" for n in ("load_balancing_loss", "z_loss") for i in range(3)
    ]
    assert [e.value for e in acc.Scalars("moe/load_balancing_loss_layer_2")] == [4.0]
    assert [e.value for e in acc.Scalars("moe/load_balancing_loss_layer_0")] == [0.0]
