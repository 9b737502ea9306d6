"""The optimizer's step traffic: fused AdamW chosen for CUDA params (foreach elsewhere), and the fp32 main params
copied back to fp16/bf16 model params in one multi-tensor call, equal to per-param copies."""
import torch

from megatron.core.optimizer import Float16OptimizerWithFloat16Params, OptimizerConfig, get_megatron_optimizer
from op_recorder import OpRecorder


def _model(dtype=torch.bfloat16, layers=6):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)]).to(dtype)


def _set_grads(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.main_grad = torch.randn(p.shape, generator=g)


def _pairs(opt):
    """(bf16 model param, its fp32 main param) of every group."""
    return [pair for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups)
            for pair in zip(model_group, main_group)]


def test_adam_is_fused_when_the_params_are_on_cuda(monkeypatch):
    """CPU proxy: with every param reporting is_cuda, AdamW is built with fused=True; on the CPU it is not."""
    chosen = []

    class RecordingAdamW(torch.optim.AdamW):
        def __init__(self, params, **kwargs):
            chosen.append(kwargs.get("fused"))
            super().__init__(params, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", RecordingAdamW)
    config = OptimizerConfig(lr=1e-3, bf16=True)
    get_megatron_optimizer(config, [_model()])
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    get_megatron_optimizer(config, [_model()])
    assert chosen == [None, True]


def test_main_params_reach_the_model_in_one_multi_tensor_copy():
    """Before: one aten.copy_ per bf16 param (12 here); now one _foreach_copy_ for all of them."""
    model = _model()
    reference = _model()
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True), [model])
    ref_opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True), [reference])
    assert isinstance(opt, Float16OptimizerWithFloat16Params)
    _set_grads(model)
    _set_grads(reference)
    with OpRecorder() as record:
        opt._copy_model_grads_to_main_grads()
        opt.optimizer.step()
        opt._copy_main_params_to_model_params()
    n_params = len(list(model.parameters()))
    copies = [op for op in record.ops if op.startswith("aten.copy_")]
    assert record.ops.count("aten._foreach_copy_.default") == 1 and len(copies) < n_params, record.ops
    # Same bits as copying param by param.
    ref_opt._copy_model_grads_to_main_grads()
    ref_opt.optimizer.step()
    for model_param, main_param in _pairs(ref_opt):
        model_param.data.copy_(main_param.data)
    for got, want in zip(model.parameters(), reference.parameters()):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_reload_copies_model_params_to_main_params():
    model = _model()
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True), [model])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    opt.reload_model_params()
    for model_param, main_param in _pairs(opt):
        assert main_param.dtype == torch.float32 and torch.equal(main_param, model_param.float())
