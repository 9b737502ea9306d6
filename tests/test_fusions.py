"""--bias-gelu-fusion / --bias-swiglu-fusion / --bias-dropout-fusion: on by default, they switch the layer to the
fused functions, and the fused path (compiled forward and backward) equals the unfused one within 1e-6 in fp32."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core import tensor_parallel
from megatron.core.fusions import fused_bias_activation, fused_bias_dropout, pointwise
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

S, B, H = 8, 2, 16
COMMON = ["--num-layers", "1", "--hidden-size", str(H), "--num-attention-heads", "4", "--seq-length", str(S),
          "--max-position-embeddings", str(S), "--micro-batch-size", str(B), "--train-iters", "1", "--lr", "1e-3"]


def _config(*flags):
    return core_transformer_config_from_args(validate_args(parse_args(args=COMMON + list(flags))))


def test_fusion_flags_are_on_by_default_and_reach_the_config():
    on, off = _config(), _config("--no-bias-gelu-fusion", "--no-bias-dropout-fusion")
    assert on.bias_activation_fusion and on.bias_dropout_fusion
    assert not off.bias_activation_fusion and not off.bias_dropout_fusion
    assert _config("--swiglu").bias_activation_fusion and not _config("--swiglu", "--no-bias-swiglu-fusion") \
        .bias_activation_fusion


def _layer(fused, **kw):
    cfg = dict(num_layers=1, hidden_size=H, num_attention_heads=4, use_cpu_initialization=True,
               hidden_dropout=0.1, attention_dropout=0.0, bias_activation_fusion=fused, bias_dropout_fusion=fused)
    cfg.update(kw)
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    layer = TransformerLayer(TransformerConfig(**cfg))
    with torch.no_grad():  # non-zero biases, so the bias adds are exercised
        for name, param in layer.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    return layer


@pytest.fixture
def calls(monkeypatch):
    """Record which bias-activation / bias-dropout-add implementations a layer calls."""
    seen = []

    def recording(name, fn):
        def run(*args, **kwargs):
            seen.append(name)
            return fn(*args, **kwargs)
        return run

    from megatron.core.transformer import mlp
    for name in ("bias_activation", "bias_activation_fused"):
        monkeypatch.setattr(mlp, name, recording(name, getattr(mlp, name)))
    for name in ("bias_dropout_add", "bias_dropout_add_fused"):
        monkeypatch.setattr(fused_bias_dropout, name, recording(name, getattr(fused_bias_dropout, name)))
    return seen


@pytest.mark.parametrize("fused", [True, False])
def test_the_flags_switch_the_path(fused, calls):
    layer = _layer(fused)
    layer(torch.randn(S, B, H))
    suffix = "_fused" if fused else ""
    assert calls == [f"bias_dropout_add{suffix}", f"bias_activation{suffix}", f"bias_dropout_add{suffix}"]


@pytest.fixture
def compile_on_cpu(monkeypatch):
    """Take fuse_pointwise's compiled branch on the CPU: aot_eager traces forward and backward as inductor
    would (AOT autograd), without inductor's C++ build."""
    torch._dynamo.reset()
    real_compile = torch.compile
    monkeypatch.setattr(pointwise, "compiles_on", lambda tensor: True)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, **{**kw, "backend": "aot_eager"}))
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _forward_backward(fn, tensors, *consts):
    """fn(*tensors, *consts) and the grads of ``tensors`` (None entries pass through) for a fixed output grad."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]
    out = fn(*leaves, *consts)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach(), [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("activation, gated", [(F.gelu, False), (F.silu, True)], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_compiled_bias_activation_equals_unfused(activation, gated, with_bias, compile_on_cpu):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(S, B, 64, generator=g) * 3
    bias = torch.randn(64, generator=g) if with_bias else None
    ref_out, ref_grads = _forward_backward(fused_bias_activation.bias_activation, (x, bias), activation, gated)
    out, grads = _forward_backward(fused_bias_activation.bias_activation_fused, (x, bias), activation, gated)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "the fused path did not compile"
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("training", [True, False])
def test_compiled_bias_dropout_add_equals_unfused_without_dropout(training, compile_on_cpu):
    """p = 0 (or eval): the compiled chain equals the unfused one; masks of compiled dropout come from
    inductor's own RNG on CUDA, so p > 0 is compared as a whole layer on the CPU below."""
    g = torch.Generator().manual_seed(0)
    x, bias, residual = torch.randn(S, B, H, generator=g), torch.randn(H, generator=g), torch.randn(S, B, H, generator=g)

    consts = (0.0 if training else 0.1, training)
    ref_out, ref_grads = _forward_backward(fused_bias_dropout.bias_dropout_add, (x, bias, residual), *consts)
    out, grads = _forward_backward(fused_bias_dropout.bias_dropout_add_fused, (x, bias, residual), *consts)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "the fused path did not compile"
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_fused_layer_with_dropout_equals_unfused_on_cpu():
    """Training mode, dropout 0.1, same seed: forward and every grad of a whole layer agree (CPU runs the
    fused functions' ops eagerly, drawing the same dropout masks)."""
    results = []
    for fused in (False, True):
        layer = _layer(fused)
        layer.train()
        torch.manual_seed(5)
        x = torch.randn(S, B, H, requires_grad=True)
        out, _ = layer(x)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (ref, ref_dx, ref_grads), (got, dx, grads) = results
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(dx, ref_dx, rtol=0, atol=1e-6)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-6, msg=name)
