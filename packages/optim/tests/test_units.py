"""Single-process units: loss scaler, scheduler closed forms, config validation."""

import math

import pytest

from pentatron.optim import (
    DDPConfig,
    DynamicGradScaler,
    OptimConfigError,
    OptimizerConfig,
    OptimizerParamScheduler,
    SchedulerMismatchError,
)

# --- loss scaler ---------------------------------------------------------------------


def test_scaler_grows_after_window_of_clean_steps():
    s = DynamicGradScaler(initial_scale=8.0, growth_interval=3, hysteresis=2)
    for _ in range(2):
        s.update(False)
    assert s.scale == 8.0
    s.update(False)
    assert s.scale == 16.0 and s.growth_tracker == 0


def test_scaler_hysteresis_then_backoff_and_min():
    s = DynamicGradScaler(initial_scale=8.0, min_scale=2.0, growth_interval=100, hysteresis=2)
    s.update(True)
    assert s.scale == 8.0  # first overflow tolerated
    s.update(True)
    assert s.scale == 4.0
    s.update(True)
    assert s.scale == 2.0
    s.update(True)
    assert s.scale == 2.0  # clamped at min_scale


def test_scaler_overflow_resets_growth_and_state_round_trips():
    s = DynamicGradScaler(initial_scale=4.0, growth_interval=2, hysteresis=1)
    s.update(False)
    s.update(True)  # resets growth count, backs off (hysteresis 1)
    assert s.scale == 2.0 and s.growth_tracker == 0
    s.update(False)
    assert s.scale == 2.0
    t = DynamicGradScaler(initial_scale=1.0, growth_interval=2, hysteresis=1)
    t.load_state_dict(s.state_dict())
    s.update(False)
    t.update(False)
    assert s.scale == t.scale == 4.0


# --- scheduler -----------------------------------------------------------------------
class _Opt:
    def __init__(self):
        self.param_groups = [{"lr_mult": 1.0, "wd_mult": 1.0}, {"lr_mult": 0.5, "wd_mult": 0.0}]


def _closed_form(style, n, warm=10, decay=100, max_lr=1.0, min_lr=0.1, wsd=20, wsd_style=None):
    if n <= warm:
        return max_lr * n / warm  # init_lr = 0
    if style == "constant":
        return max_lr
    if n > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(warm / n))
    r = (n - warm) / (decay - warm)
    if style == "linear":
        return max_lr - (max_lr - min_lr) * r
    if style == "cosine":
        return min_lr + (max_lr - min_lr) * (1 + math.cos(math.pi * r)) / 2
    q = max(0.0, (n - (decay - wsd)) / wsd)  # WSD: flat, then the anneal over the last wsd
    c = {
        "linear": 1 - q,
        "cosine": (1 + math.cos(math.pi * q)) / 2,
        "exponential": 2 * 0.5**q - 1,
        "minus_sqrt": 1 - math.sqrt(q),
    }[wsd_style]
    return min_lr + (max_lr - min_lr) * c


STYLES = [
    ("constant", None),
    ("linear", None),
    ("cosine", None),
    ("inverse-square-root", None),
    ("WSD", "linear"),
    ("WSD", "cosine"),
    ("WSD", "exponential"),
    ("WSD", "minus_sqrt"),
]


@pytest.mark.parametrize(("style", "wsd_style"), STYLES)
def test_lr_and_wd_follow_closed_forms(style, wsd_style):
    opt = _Opt()
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=1.0,
        min_lr=0.1,
        lr_warmup_steps=10,
        lr_decay_steps=100,
        lr_decay_style=style,
        start_wd=0.0,
        end_wd=0.1,
        wd_incr_steps=50,
        wd_incr_style="cosine",
        wsd_decay_steps=20,
        lr_wsd_decay_style=wsd_style,
    )
    for n in range(0, 121):
        if n:
            sched.step(1)
        lr = _closed_form(style, n, wsd_style=wsd_style)
        wd = 0.1 if n > 50 else 0.1 * (1 - math.cos(math.pi * n / 50)) / 2
        assert opt.param_groups[0]["lr"] == pytest.approx(lr, abs=1e-12), n
        assert opt.param_groups[1]["lr"] == pytest.approx(0.5 * lr, abs=1e-12), n
        assert opt.param_groups[0]["weight_decay"] == pytest.approx(wd, abs=1e-12), n
        assert opt.param_groups[1]["weight_decay"] == 0.0


def _sched(opt, **kw):
    args = dict(
        init_lr=0.0,
        max_lr=1.0,
        min_lr=0.0,
        lr_warmup_steps=5,
        lr_decay_steps=50,
        lr_decay_style="cosine",
        start_wd=0.0,
        end_wd=0.1,
        wd_incr_steps=50,
        wd_incr_style="linear",
    )
    args.update(kw)
    return OptimizerParamScheduler(opt, **args)


def test_scheduler_state_round_trip_and_override_rules():
    a = _sched(_Opt())
    a.step(17)
    b = _sched(_Opt())
    b.load_state_dict(a.state_dict())
    assert b.num_steps == 17 and b.optimizer.param_groups == a.optimizer.param_groups
    c = _sched(_Opt(), max_lr=2.0, use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(SchedulerMismatchError, match=r"max_lr.*use_checkpoint_opt_param_sch"):
        c.load_state_dict(a.state_dict())
    try:
        c.load_state_dict(a.state_dict())
    except SchedulerMismatchError as e:  # the values, for an app to name its own flags
        assert (e.field, e.mine, e.saved) == ("max_lr", 2.0, a.max_lr)
    d = _sched(
        _Opt(),
        max_lr=2.0,
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )
    d.load_state_dict(a.state_dict())
    assert d.max_lr == 2.0 and d.num_steps == 17
    e = _sched(_Opt(), max_lr=2.0)  # use the checkpoint's values
    e.load_state_dict(a.state_dict())
    assert e.max_lr == 1.0


# --- config validation ----------------------------------------------------------------
BAD = [
    (OptimizerConfig, dict(fp16=True, bf16=True), r"fp16=True: fp16 and bf16 are exclusive.*fix"),
    (OptimizerConfig, dict(optimizer="lamb"), r"optimizer='lamb'.*fix"),
    (OptimizerConfig, dict(lr=1e-4, min_lr=1e-3), r"min_lr=0.001: must not exceed lr.*fix"),
    (OptimizerConfig, dict(adam_beta2=1.0), r"adam_beta2=1.0: must lie in \[0, 1\)"),
    (OptimizerConfig, dict(hysteresis=0), r"hysteresis=0: must be an integer >= 1"),
    (OptimizerConfig, dict(loss_scale=-1.0), r"loss_scale=-1.0: must be > 0"),
    (DDPConfig, dict(bucket_size=0), r"bucket_size=0: must be a positive number.*fix"),
    (DDPConfig, dict(bucket_size=-5), r"bucket_size=-5"),
    (
        DDPConfig,
        dict(overlap_param_gather=True),
        r"overlap_param_gather=True: .*distributed optimizer.*fix: set use_distributed_optimizer",
    ),
]


@pytest.mark.parametrize(("cls", "kwargs", "message"), BAD)
def test_bad_config_names_field_rule_and_fix(cls, kwargs, message):
    with pytest.raises(OptimConfigError, match=message):
        cls(**kwargs)


def test_bad_schedule_rejected():
    with pytest.raises(OptimConfigError, match="lr_warmup_steps=60: must be below"):
        _sched(_Opt(), lr_warmup_steps=60)
    with pytest.raises(OptimConfigError, match="wsd_decay_steps=None: WSD needs"):
        _sched(_Opt(), lr_decay_style="WSD")


def test_default_bucket_size_rule():
    assert DDPConfig().resolved_bucket_size(8) is None  # no overlap: one bucket
    assert DDPConfig(overlap_grad_reduce=True).resolved_bucket_size(64) == 64_000_000
    assert DDPConfig(overlap_grad_reduce=True).resolved_bucket_size(2) == 40_000_000
