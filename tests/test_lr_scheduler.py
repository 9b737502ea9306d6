"""OptimizerParamScheduler against direct evaluation of the Megatron-LM formulas (steps in samples)."""
import math
from types import SimpleNamespace

import pytest

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

INIT, MAX, MIN, WARMUP, DECAY, WSD = 1e-5, 1e-3, 1e-4, 100, 1000, 300
STEPS = [0, 1, 50, 100, 101, 250, 500, 699, 700, 701, 850, 999, 1000, 1001, 5000]


def _optimizer(*groups):
    return SimpleNamespace(param_groups=[dict(g) for g in groups] or [{}])


def _scheduler(style, wsd_style=None, **kwargs):
    args = dict(init_lr=INIT, max_lr=MAX, min_lr=MIN, lr_warmup_steps=WARMUP, lr_decay_steps=DECAY,
                lr_decay_style=style, start_wd=0.01, end_wd=0.01, wd_incr_steps=DECAY, wd_incr_style="constant",
                wsd_decay_steps=WSD if style == "WSD" else None, lr_wsd_decay_style=wsd_style)
    args.update(kwargs)
    opt = args.pop("optimizer", None) or _optimizer()
    return opt, OptimizerParamScheduler(opt, **args)


def _expected_lr(style, n, wsd_style=None, max_lr=MAX, min_lr=MIN):
    """The spec's formulas, written out independently of the implementation."""
    if n <= WARMUP:
        return INIT + (max_lr - INIT) * n / WARMUP
    if style == "constant":
        return max_lr
    if n > DECAY:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(WARMUP) / math.sqrt(n))
    r = (n - WARMUP) / (DECAY - WARMUP)
    if style == "linear":
        coeff = 1 - r
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * r) + 1)
    else:
        start = DECAY - WSD
        w = max(0.0, (n - start) / WSD)
        coeff = {"linear": 1 - w, "cosine": 0.5 * (math.cos(math.pi * w) + 1), "exponential": 2 * 0.5 ** w - 1,
                 "minus_sqrt": 1 - math.sqrt(w)}[wsd_style] if n > start else 1.0
    return min_lr + coeff * (max_lr - min_lr)


@pytest.mark.parametrize("style,wsd_style", [
    ("constant", None), ("linear", None), ("cosine", None), ("inverse-square-root", None),
    ("WSD", "exponential"), ("WSD", "linear"), ("WSD", "cosine"), ("WSD", "minus_sqrt"),
])
def test_lr_decay_styles_match_formulas(style, wsd_style):
    opt, sched = _scheduler(style, wsd_style)
    previous = 0
    for n in STEPS:
        sched.step(n - previous)
        previous = n
        assert sched.num_steps == n
        assert opt.param_groups[0]["lr"] == pytest.approx(_expected_lr(style, n, wsd_style), rel=1e-12, abs=1e-15)


def test_per_group_max_min_and_multipliers():
    groups = ({"wd_mult": 1.0, "lr_mult": 1.0}, {"wd_mult": 0.0, "lr_mult": 2.0, "max_lr": 5e-3, "min_lr": 0.0})
    opt, sched = _scheduler("cosine", optimizer=_optimizer(*groups))
    sched.step(400)
    assert opt.param_groups[0]["lr"] == pytest.approx(_expected_lr("cosine", 400))
    assert opt.param_groups[1]["lr"] == pytest.approx(2.0 * _expected_lr("cosine", 400, max_lr=5e-3, min_lr=0.0))
    assert (opt.param_groups[0]["weight_decay"], opt.param_groups[1]["weight_decay"]) == (0.01, 0.0)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_increment(style):
    opt, sched = _scheduler("linear", start_wd=0.0, end_wd=0.1, wd_incr_steps=800, wd_incr_style=style)
    previous = 0
    for n in (0, 200, 400, 800, 801):
        sched.step(n - previous)
        previous = n
        r = min(n / 800, 1.0)
        coeff = r if style == "linear" else 0.5 * (math.cos(math.pi * (1 - r)) + 1)
        assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.1 * coeff, abs=1e-15)


def test_state_dict_keys_and_checkpoint_rules():
    _, sched = _scheduler("cosine")
    sched.step(300)
    state = sched.state_dict()
    assert set(state) == {"max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps", "min_lr",
                          "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps"}

    opt, same = _scheduler("cosine", use_checkpoint_opt_param_scheduler=False)
    same.load_state_dict(state)
    assert same.num_steps == 300 and opt.param_groups[0]["lr"] == pytest.approx(_expected_lr("cosine", 300))

    _, differs = _scheduler("cosine", max_lr=2e-3, use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match="learning rate"):
        differs.load_state_dict(state)

    _, from_ckpt = _scheduler("linear", max_lr=2e-3, use_checkpoint_opt_param_scheduler=True)
    from_ckpt.load_state_dict(state)
    assert (from_ckpt.max_lr, from_ckpt.lr_decay_style, from_ckpt.num_steps) == (MAX, "cosine", 300)

    _, override = _scheduler("linear", max_lr=2e-3, use_checkpoint_opt_param_scheduler=False,
                             override_opt_param_scheduler=True)
    override.load_state_dict(state)
    assert (override.max_lr, override.lr_decay_style, override.num_steps) == (2e-3, "linear", 300)


@pytest.mark.parametrize("kwargs,message", [
    (dict(min_lr=2e-3), "max_lr"),
    (dict(init_lr=2e-3), "init_lr"),
    (dict(lr_warmup_steps=1000), "lr_warmup_steps"),
    (dict(lr_decay_style="step"), "lr_decay_style"),
    (dict(start_wd=0.0, end_wd=0.1), "constant weight decay"),
    (dict(override_opt_param_scheduler=True), "mutually exclusive"),
])
def test_invalid_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _scheduler("linear", **kwargs)


def test_wsd_needs_decay_steps():
    with pytest.raises(ValueError, match="wsd_decay_steps"):
        _scheduler("WSD", "linear", wsd_decay_steps=None)
