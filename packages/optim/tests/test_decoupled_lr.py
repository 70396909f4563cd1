"""Megatron's decoupled_lr: params tagged `is_embedding_or_output_parameter` get their own
peak (and min) lr through the same schedule; the rest keep `lr`."""

from __future__ import annotations

import pytest
import torch

from pentatron.optim import OptimizerConfig, OptimizerParamScheduler, get_param_groups
from pentatron.optim.errors import OptimConfigError as ConfigError


def _model() -> torch.nn.Module:
    m = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4))
    m[0].weight.is_embedding_or_output_parameter = True
    return m


def test_tagged_params_get_the_decoupled_peak_and_min():
    groups = get_param_groups([_model()], decoupled_lr=0.5, decoupled_min_lr=0.05)
    tagged = [g for g in groups if "max_lr" in g]
    assert len(tagged) == 1 and tagged[0]["max_lr"] == 0.5 and tagged[0]["min_lr"] == 0.05
    assert tagged[0]["params"][0].shape == (8, 4)
    assert [g["is_decoupled_lr"] for g in groups] == [g in tagged for g in groups]  # Megatron's
    assert all("max_lr" not in g for g in get_param_groups([_model()]))  # off by default

    opt = torch.optim.SGD(groups, lr=1.0)
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=1.0,
        min_lr=0.1,
        lr_warmup_steps=2,
        lr_decay_steps=10,
        lr_decay_style="linear",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=10,
        wd_incr_style="constant",
    )
    sched.step(1)  # warm-up half way: 0.5 of each group's own peak
    lrs = {("max_lr" in g): g["lr"] for g in opt.param_groups}
    assert lrs == {True: pytest.approx(0.25), False: pytest.approx(0.5)}
    sched.step(9)  # end of decay: each group's own min
    lrs = {("max_lr" in g): g["lr"] for g in opt.param_groups}
    assert lrs == {True: pytest.approx(0.05), False: pytest.approx(0.1)}


def test_decoupled_min_lr_needs_decoupled_lr():
    with pytest.raises(ConfigError, match="decoupled_min_lr"):
        OptimizerConfig(decoupled_min_lr=0.1)
    with pytest.raises(ConfigError, match="decoupled_min_lr"):
        OptimizerConfig(decoupled_lr=0.1, decoupled_min_lr=0.2)
