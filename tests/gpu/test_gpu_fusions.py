"""CUDA: the fused bias-activation and bias-dropout-add chains compile to fewer kernels and equal the unfused ops."""
import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from megatron.core.fusions.fused_bias_activation import bias_activation, bias_activation_fused
from megatron.core.fusions.fused_bias_dropout import bias_dropout_add, bias_dropout_add_fused

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

S, B, F_SIZE = 128, 4, 512


def _cuda_kernels(fn):
    """CUDA kernels one call of ``fn`` launches (after a warm-up call that compiles it)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def _run(fn, tensors, *consts):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves, *consts)
    out.backward(torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out))
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("activation, gated", [(F.gelu, False), (F.silu, True)], ids=["gelu", "swiglu"])
def test_cuda_fused_bias_activation_equals_unfused_with_fewer_kernels(activation, gated):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(S, B, F_SIZE, device="cuda", generator=g) * 3
    bias = torch.randn(F_SIZE, device="cuda", generator=g)
    ref_out, ref_grads = _run(bias_activation, (x, bias), activation, gated)
    out, grads = _run(bias_activation_fused, (x, bias), activation, gated)  # compiles on first call
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    fused = _cuda_kernels(lambda: bias_activation_fused(x, bias, activation, gated))
    unfused = _cuda_kernels(lambda: bias_activation(x, bias, activation, gated))
    assert fused < unfused, (fused, unfused)


def test_cuda_fused_bias_dropout_add_equals_unfused_without_dropout_and_keeps_the_rate():
    g = torch.Generator(device="cuda").manual_seed(0)
    x, residual = torch.randn(S, B, F_SIZE, device="cuda", generator=g), torch.zeros(S, B, F_SIZE, device="cuda")
    bias = torch.randn(F_SIZE, device="cuda", generator=g)
    ref_out, ref_grads = _run(bias_dropout_add, (x, bias, residual), 0.0, True)
    out, grads = _run(bias_dropout_add_fused, (x, bias, residual), 0.0, True)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    # p = 0.1: inductor draws its own mask; the kept fraction and the 1/(1-p) scale must hold.
    ones = torch.ones(S, B, F_SIZE, device="cuda")
    dropped = bias_dropout_add_fused(ones, None, torch.zeros_like(ones), 0.1, True)
    kept = dropped != 0
    assert abs(kept.float().mean().item() - 0.9) < 0.01
    torch.testing.assert_close(dropped[kept], torch.full_like(dropped[kept], 1 / 0.9))
