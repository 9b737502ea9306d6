"""CUDA: AdamW runs its fused kernel, equal to the foreach one, and the bf16 model params get the updated values."""
import pytest
import torch

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to("cuda", torch.bfloat16)


def _step(opt, model, steps=3):
    for step in range(steps):
        g = torch.Generator(device="cuda").manual_seed(step)
        for p in model.parameters():
            p.main_grad = torch.randn(p.shape, device="cuda", generator=g)
        assert opt.step()[0]
    return [p.detach().clone() for p in opt.main_param_copies()], [p.detach().clone() for p in model.parameters()]


def test_cuda_adam_is_fused_and_matches_foreach(monkeypatch):
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, bf16=True, clip_grad=1.0)
    fused_model = _model()
    fused = get_megatron_optimizer(config, [fused_model])
    assert fused.optimizer.defaults["fused"] is True
    main, params = _step(fused, fused_model)

    import megatron.core.optimizer as optimizer_module
    monkeypatch.setattr(optimizer_module, "adam_implementation", lambda params: {"foreach": True})
    foreach_model = _model()
    foreach = get_megatron_optimizer(config, [foreach_model])
    assert not foreach.optimizer.defaults["fused"]
    ref_main, ref_params = _step(foreach, foreach_model)
    for got, want in zip(main, ref_main):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for (model_group, main_group) in zip(fused.float16_groups, fused.fp32_from_float16_groups):
        for model_param, main_param in zip(model_group, main_group):
            assert torch.equal(model_param, main_param.to(torch.bfloat16))
    for got, want in zip(params, ref_params):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
