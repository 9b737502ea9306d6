"""Param groups, grad clipping, loss scalers and the fp32 / fp16 / bf16 optimizer wrappers (single process)."""
import io
import math

import pytest
import torch

from megatron.core.optimizer import (
    ConstantGradScaler,
    DynamicGradScaler,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
    get_megatron_optimizer,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


class Net(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(5, 4)
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.output = torch.nn.Linear(4, 3, bias=False)
        self.to(dtype)


def _names(model, group):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return sorted(by_id[id(p)] for p in group["params"])


def test_param_groups_weight_decay_exclusion_in_discovery_order():
    model = Net()
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, min_lr=1e-5, weight_decay=0.1), [model])
    assert isinstance(opt, FP32Optimizer) and isinstance(opt.optimizer, torch.optim.AdamW)
    default, no_wd = opt.param_groups
    assert default["default_config"] and not no_wd["default_config"]
    assert _names(model, default) == ["embedding.weight", "linear.weight", "output.weight"]
    assert _names(model, no_wd) == ["linear.bias", "norm.bias", "norm.weight"]
    for group in opt.param_groups:
        assert {"wd_mult", "lr_mult", "max_lr", "min_lr", "is_expert_parallel", "default_config"} <= set(group)
        assert (group["max_lr"], group["min_lr"], group["lr_mult"]) == (1e-3, 1e-5, 1.0)
    assert (default["wd_mult"], no_wd["wd_mult"]) == (1.0, 0.0)
    sched = OptimizerParamScheduler(opt, 0.0, 1e-3, 1e-5, 0, 100, "constant", 0.1, 0.1, 100, "constant")
    sched.step(1)
    assert default["weight_decay"] == 0.1 and no_wd["weight_decay"] == 0.0


def test_param_groups_custom_conditions_and_decoupled_lr():
    model = Net()
    model.embedding.weight.is_embedding_or_output_parameter = True
    config = OptimizerConfig(lr=1e-3, min_lr=0.0, decoupled_lr=5e-3, decoupled_min_lr=1e-4, optimizer="sgd")
    opt = get_megatron_optimizer(config, [model], no_weight_decay_cond=lambda n, p: n.startswith("norm"),
                                 scale_lr_cond=lambda n, p: n.startswith("output"), lr_mult=3.0)
    assert isinstance(opt.optimizer, torch.optim.SGD)
    groups = {tuple(_names(model, g)): g for g in opt.param_groups}
    # megatron-core 0.14 keeps the groups in the order their first param appears.
    assert [_names(model, g) for g in opt.param_groups] == [
        ["embedding.weight"], ["linear.bias", "linear.weight"], ["norm.bias", "norm.weight"], ["output.weight"]]
    assert groups[("linear.bias", "linear.weight")]["wd_mult"] == 1.0  # bias decays under a custom condition
    assert groups[("norm.bias", "norm.weight")]["wd_mult"] == 0.0
    assert groups[("output.weight",)]["lr_mult"] == 3.0
    emb = groups[("embedding.weight",)]
    assert (emb["max_lr"], emb["min_lr"]) == (5e-3, 1e-4)


def test_optimizer_config_errors():
    with pytest.raises(ValueError, match="--lr"):
        get_megatron_optimizer(OptimizerConfig(), [Net()])
    with pytest.raises(ValueError, match="'lion'"):
        get_megatron_optimizer(OptimizerConfig(lr=1.0, optimizer="lion"), [Net()])


def _grads(seed, shapes=((3, 4), (5,), (2, 2))):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


@pytest.mark.parametrize("norm_type", [2.0, 3.0, math.inf])
def test_clip_matches_torch_clip_grad_norm(norm_type):
    ours, ref = _grads(1), _grads(1)
    max_norm = 0.5
    norm = get_grad_norm_fp32([p.grad for p in ours], norm_type=norm_type)
    clip_grad_by_total_norm_fp32(ours, max_norm, norm)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type=norm_type)
    assert norm == pytest.approx(ref_norm.item(), rel=1e-6)
    for a, b in zip(ours, ref):
        assert torch.allclose(a.grad, b.grad, atol=1e-7)


def test_cpu_grad_norm_does_not_depend_on_how_the_tensor_is_split():
    """A million-element grad (an embedding's) has the same norm whole or split as TP ranks hold it."""
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(50432, 32, generator=g) * torch.rand(50432, 1, generator=g) ** 4 * 1e-3
    exact = grad.double().norm().item()
    whole = get_grad_norm_fp32([grad])
    halves = get_grad_norm_fp32(list(grad.chunk(2)))
    quarters = get_grad_norm_fp32(list(grad.chunk(4, dim=1)))
    assert whole == pytest.approx(exact, rel=1e-9)
    assert halves == pytest.approx(whole, rel=1e-9) and quarters == pytest.approx(whole, rel=1e-9)


def test_clip_skipped_below_threshold_and_nan_norm():
    params = _grads(2)
    before = [p.grad.clone() for p in params]
    norm = get_grad_norm_fp32([p.grad for p in params])
    clip_grad_by_total_norm_fp32(params, norm * 2, norm)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, params))
    params[0].grad[0, 0] = float("nan")
    nan_norm = get_grad_norm_fp32([p.grad for p in params])
    assert math.isnan(nan_norm)
    clip_grad_by_total_norm_fp32(params, 1.0, nan_norm)  # NaN coefficient: grads untouched
    assert torch.equal(params[1].grad, before[1])


def test_norm_and_zero_count_skip_shared_and_tp_duplicates():
    params = _grads(3)
    params[0].shared = True                  # tied output copy: never counted
    params[1].tensor_model_parallel = False  # replicated: counted on TP rank 0 only (this rank)
    params[2].grad[0] = 0.0
    expected = torch.cat([params[1].grad.flatten(), params[2].grad.flatten()]).norm().item()
    opt = FP32Optimizer(torch.optim.SGD(params, lr=0.1), OptimizerConfig(lr=0.1))
    assert opt.get_grad_norm() == pytest.approx(expected, rel=1e-6)
    expected_zeros = int((params[1].grad == 0).sum() + (params[2].grad == 0).sum())
    assert count_zeros_fp32(params) == expected_zeros == 2


def test_fp32_optimizer_uses_main_grad_and_reports():
    model = Net()
    reference = Net()
    for p, r in zip(model.parameters(), reference.parameters()):
        g = torch.randn_like(p)
        p.main_grad = g.clone()
        r.grad = g.clone()
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.1, clip_grad=0.0, log_num_zeros_in_grad=True,
                                                 optimizer="sgd", weight_decay=0.0, sgd_momentum=0.0), [model])
    ok, grad_norm, zeros = opt.step()
    assert (ok, grad_norm, zeros) == (True, 0.0, 0)  # clip_grad 0: norm 0.0 and no clipping
    with torch.no_grad():
        for r in reference.parameters():
            r -= 0.1 * r.grad
    for p, r in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, r, atol=1e-7)
    assert opt.get_loss_scale().item() == 1.0
    model.linear.weight.main_grad[0, 0] = float("inf")
    opt.config.clip_grad = 1.0
    ok, grad_norm, _ = opt.step()
    assert ok and math.isinf(grad_norm)


def test_dynamic_scaler_state_machine():
    scaler = DynamicGradScaler(initial_scale=2.0 ** 4, min_scale=2.0, growth_factor=2.0, backoff_factor=0.5,
                               growth_interval=3, hysteresis=2)
    scaler.update(True)                                   # hysteresis absorbs the first overflow
    assert scaler.scale.item() == 16.0 and scaler.state_dict()["hysteresis_tracker"] == 1
    scaler.update(True)                                   # tracker reaches 0: back off
    assert scaler.scale.item() == 8.0
    scaler.update(True)                                   # stays <= 0: every overflow backs off
    assert scaler.scale.item() == 4.0
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale.item() == 4.0 and scaler.state_dict()["growth_tracker"] == 2
    scaler.update(False)                                  # window of 3 clean steps: grow, refill hysteresis
    state = scaler.state_dict()
    assert scaler.scale.item() == 8.0 and state["growth_tracker"] == 0 and state["hysteresis_tracker"] == 2
    for _ in range(4):
        scaler.update(True)
    assert scaler.scale.item() == 2.0                     # clamped at min_scale
    assert scaler.inv_scale.item() == 0.5
    restored = DynamicGradScaler(1024.0, 1.0, 2.0, 0.5, 1000, 2)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict()["scale"].item() == 2.0
    assert restored.state_dict()["hysteresis_tracker"] == scaler.state_dict()["hysteresis_tracker"]
    with pytest.raises(ValueError, match="hysteresis"):
        DynamicGradScaler(1.0, 1.0, 2.0, 0.5, 10, 0)
    constant = ConstantGradScaler(8.0)
    constant.update(True)
    assert constant.scale.item() == 8.0 and constant.state_dict() == {}


@pytest.mark.parametrize("dtype,loss_scale", [(torch.bfloat16, None), (torch.bfloat16, 64.0), (torch.float16, None)])
def test_float16_wrapper_step_and_skip_on_inf(dtype, loss_scale):
    model = Net(dtype)
    config = OptimizerConfig(lr=0.5, optimizer="sgd", sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0,
                             fp16=dtype == torch.float16, bf16=dtype == torch.bfloat16, params_dtype=dtype,
                             loss_scale=loss_scale, initial_loss_scale=2.0 ** 10)
    opt = get_megatron_optimizer(config, [model])
    assert isinstance(opt, Float16OptimizerWithFloat16Params)
    scale = opt.get_loss_scale().item()
    assert scale == (loss_scale or (2.0 ** 10 if dtype == torch.float16 else 1.0))
    pairs = [(m, f) for mg, fg in zip(opt.float16_groups, opt.fp32_from_float16_groups) for m, f in zip(mg, fg)]
    assert len(pairs) == len(list(model.parameters()))
    main_before = [f.detach().clone() for _, f in pairs]
    assert all(f.dtype == torch.float32 for f in main_before)
    grads = [torch.randn(m.shape) * 0.01 for m, _ in pairs]
    for (m, _), g in zip(pairs, grads):
        m.main_grad = (g * scale).to(torch.float32)  # what backward of the scaled loss leaves in the buffer
    ok, _, _ = opt.step()
    assert ok
    for (m, f), before, g in zip(pairs, main_before, grads):
        assert torch.allclose(f, before - 0.5 * g, atol=1e-6)  # unscaled update on fp32 main params
        assert m.dtype == dtype and torch.equal(m, f.to(dtype))

    if opt.grad_scaler is None:
        return  # bf16 without a scaler has no overflow check (as in Megatron-LM)
    model_before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.main_grad = torch.ones(p.shape)
    model.linear.weight.main_grad[0, 0] = float("inf")
    assert opt.step() == (False, None, None)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), model_before))
    if dtype == torch.float16:  # dynamic: hysteresis 2 -> second overflow halves the scale
        for p in model.parameters():
            p.main_grad = torch.full(p.shape, float("nan"))
        assert opt.step()[0] is False
        assert opt.get_loss_scale().item() == scale / 2


def test_float16_state_dict_roundtrip():
    config = OptimizerConfig(lr=0.1, bf16=True, loss_scale=None, weight_decay=0.0)
    model = Net(torch.bfloat16)
    opt = get_megatron_optimizer(config, [model])
    for p in model.parameters():
        p.main_grad = torch.randn(p.shape)
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert set(state) == {"optimizer", "fp32_from_fp16_params"}
    fresh_model = Net(torch.bfloat16)
    fresh = get_megatron_optimizer(config, [fresh_model])
    fresh.load_state_dict(state)
    for a, b in zip(fresh.fp32_from_float16_groups, opt.fp32_from_float16_groups):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert fresh.optimizer.state_dict()["state"][0]["exp_avg"].equal(opt.optimizer.state_dict()["state"][0]["exp_avg"])
    # reload_model_params copies model params into the main params
    with torch.no_grad():
        fresh_model.linear.weight.fill_(2.0)
    fresh.reload_model_params()
    assert any(torch.equal(p, torch.full_like(p, 2.0)) for g in fresh.fp32_from_float16_groups for p in g)
    state["fp32_from_fp16_params"] = state["fp32_from_fp16_params"][:1]
    with pytest.raises(ValueError, match="fp32_from_fp16_params"):
        fresh.load_state_dict(state)


def test_fp16_needs_scaler_and_scale_loss():
    model = Net(torch.float16)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="grad scaler"):
        Float16OptimizerWithFloat16Params(inner, OptimizerConfig(lr=0.1, fp16=True), None)
    opt = Float16OptimizerWithFloat16Params(inner, OptimizerConfig(lr=0.1, fp16=True), ConstantGradScaler(4.0))
    assert opt.scale_loss(torch.tensor(1.5)).item() == 6.0


def test_name_keyed_state_loads_whatever_the_saved_group_order():
    """A name-keyed optimizer state whose param groups were saved in another order (earlier versions put
    the default group first) puts every Adam moment and every group's hyper-parameters on its own params."""
    config = OptimizerConfig(lr=1e-3, min_lr=1e-5, weight_decay=0.1)
    model, fresh_model = Net(), Net()
    opt, fresh = get_megatron_optimizer(config, [model]), get_megatron_optimizer(config, [fresh_model])
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.optimizer.step()
    saved = opt.inner_state_dict_by_name()
    saved["param_groups"] = list(reversed(saved["param_groups"]))
    fresh.load_inner_state_dict(saved)

    def wd_mult_of(optimizer, param):
        return next(g["wd_mult"] for g in optimizer.param_groups if any(q is param for q in g["params"]))

    fresh_params = dict(fresh_model.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(fresh.optimizer.state[fresh_params[name]]["exp_avg"],
                                   opt.optimizer.state[param]["exp_avg"], rtol=0, atol=0)
        assert wd_mult_of(fresh, fresh_params[name]) == wd_mult_of(opt, param), name
