"""bf16/fp16 fused weight-grad accumulation: fp32 main_grad equal to the unfused path, and no fp32 activation copy."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core import tensor_parallel as tp
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.wgrad import accumulate_weight_grad

# tokens = S*B = 64 differs from every weight dim, so a [tokens, x] tensor cannot be mistaken for the weight, and
# tokens*IN > OUT*IN: an upcast activation is bigger than the fp32 main_grad.
S, B, IN, OUT = 16, 4, 24, 40
TOKENS = S * B
MICROBATCHES = 2
LOW_PRECISION = [torch.bfloat16, torch.float16]


def _layer(kind, dtype, fusion, seed=0):
    cfg = ModelParallelConfig(use_cpu_initialization=True, params_dtype=dtype, gradient_accumulation_fusion=fusion)
    torch.manual_seed(seed)
    init = lambda w: torch.nn.init.normal_(w, 0.0, 0.2)  # noqa: E731
    if kind == "column":
        return tp.ColumnParallelLinear(IN, OUT, config=cfg, init_method=init, bias=True)
    return tp.RowParallelLinear(IN, OUT, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                                skip_bias_add=False)


def _attach_main_grad(layer):
    """What DistributedDataParallel(grad_reduce_in_fp32=True) gives a weight: an fp32 buffer and the flags."""
    layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32)
    layer.weight.grad_added_to_main_grad = False
    layer.weight.zero_out_wgrad = False


def _microbatches(dtype):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(S, B, IN, generator=gen).to(dtype), torch.randn(S, B, OUT, generator=gen).to(dtype))
            for _ in range(MICROBATCHES)]


def _run(layer, batches):
    """Forward/backward every micro-batch; returns the input grads."""
    grads = []
    for x, g in batches:
        x = x.clone().requires_grad_()
        out, _ = layer(x)
        out.backward(g)
        grads.append(x.grad)
    return grads


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=["bf16", "fp16"])
def test_fused_low_precision_main_grad_matches_unfused_path(kind, dtype):
    batches = _microbatches(dtype)

    fused = _layer(kind, dtype, fusion=True)
    _attach_main_grad(fused)
    fused_input_grads = _run(fused, batches)

    # Unfused: autograd's low-precision weight.grad per micro-batch, accumulated in fp32 (the DDP hook's job).
    plain = _layer(kind, dtype, fusion=False)
    plain_main_grad = torch.zeros(OUT, IN)
    for x, g in batches:
        plain.weight.grad = None
        _run(plain, [(x, g)])
        plain_main_grad += plain.weight.grad.float()

    assert fused.weight.grad_added_to_main_grad
    assert fused.weight.main_grad.dtype == torch.float32
    assert plain_main_grad.abs().sum() > 0
    # The paths differ at most by one low-precision rounding of each micro-batch's product (the
    # unfused grad is rounded; an fp32-output GEMM on CUDA is not): |diff| <= sum_i eps/2 |p_i|.
    eps = torch.finfo(dtype).eps
    products = [g.double().reshape(-1, OUT).t() @ x.double().reshape(-1, IN) for x, g in batches]
    atol = eps * max(p.abs().max().item() for p in products)
    torch.testing.assert_close(fused.weight.main_grad, plain_main_grad, rtol=eps, atol=atol)
    # And against the exact sum of products (fp64) within the same bound.
    torch.testing.assert_close(fused.weight.main_grad.double(), sum(products), rtol=eps, atol=atol)

    plain_input_grads = _run(_layer(kind, dtype, fusion=False), batches)
    for got, want in zip(fused_input_grads, plain_input_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class _OutputRecorder(TorchDispatchMode):
    """Records (op, dtype, shape) of every tensor each aten op returns."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(value, torch.Tensor):
                self.outputs.append((str(func), value.dtype, tuple(value.shape)))
        return result


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=["bf16", "fp16"])
def test_fused_low_precision_backward_makes_no_fp32_activation_copy(kind, dtype):
    """No op in the backward returns an fp32 tensor with a token dimension (an upcast [tokens, hidden])."""
    layer = _layer(kind, dtype, fusion=True)
    _attach_main_grad(layer)
    x, g = _microbatches(dtype)[0]
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    recorder = _OutputRecorder()
    with recorder:
        out.backward(g)
    assert layer.weight.main_grad.abs().sum() > 0
    assert any(op.startswith("aten.mm") for op, _, _ in recorder.outputs), recorder.outputs  # it saw the GEMMs
    fp32_with_tokens = [(op, shape) for op, dtype_, shape in recorder.outputs
                        if dtype_ == torch.float32 and (TOKENS in shape or (S in shape[:1] and B in shape[1:2]))]
    assert not fp32_with_tokens, f"fp32 copies of activations/grads in the backward: {fp32_with_tokens}"
    # Nothing fp32 bigger than the weight-sized main_grad either.
    biggest = max((torch.Size(shape).numel() for _, dtype_, shape in recorder.outputs if dtype_ == torch.float32),
                  default=0)
    assert biggest <= OUT * IN, biggest


def test_fp32_accumulation_is_todays_addmm():
    """fp32 params keep the exact old path: main_grad.addmm_(gᵀ, x), bit for bit."""
    gen = torch.Generator().manual_seed(2)
    g, x = torch.randn(TOKENS, OUT, generator=gen), torch.randn(TOKENS, IN, generator=gen)
    start = torch.randn(OUT, IN, generator=gen)
    got = start.clone()
    accumulate_weight_grad(got, g, x)
    assert torch.equal(got, start.clone().addmm_(g.t(), x))


def test_low_precision_accumulation_into_same_dtype_buffer():
    """A bf16 main_grad (grad_reduce_in_fp32 off) takes the plain in-dtype addmm_."""
    gen = torch.Generator().manual_seed(3)
    g, x = torch.randn(TOKENS, OUT, generator=gen).bfloat16(), torch.randn(TOKENS, IN, generator=gen).bfloat16()
    got = torch.zeros(OUT, IN, dtype=torch.bfloat16)
    accumulate_weight_grad(got, g, x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.zeros(OUT, IN, dtype=torch.bfloat16).addmm_(g.t(), x))
