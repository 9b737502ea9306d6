"""CUDA: the bf16/fp16 fused weight-grad path accumulates into fp32 main_grad without fp32 activation copies."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core import tensor_parallel as tp
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import wgrad

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

S, B, IN, OUT = 64, 4, 96, 160  # tokens = 256 > OUT: an upcast activation is bigger than main_grad
DTYPES = [torch.bfloat16, torch.float16]


class _Fp32Outputs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                self.shapes.append((str(func), tuple(value.shape)))
        return result


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_cuda_kernel_is_fp32_output_where_torch_has_one(dtype):
    if not wgrad._has_cuda_kernel("aten::mm.dtype"):
        pytest.skip("this torch build has no CUDA mm with out_dtype (the low-precision GEMM + add path is used)")
    kernel = wgrad.cuda_wgrad_kernel(torch.device("cuda", torch.cuda.current_device()), dtype)
    assert kernel in ("addmm", "mm"), kernel


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_cuda_fused_wgrad_matches_fp64_and_makes_no_fp32_activation_copy(dtype):
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = ModelParallelConfig(params_dtype=dtype, gradient_accumulation_fusion=True)
    torch.manual_seed(0)
    layer = tp.ColumnParallelLinear(IN, OUT, config=cfg, init_method=lambda w: torch.nn.init.normal_(w, 0, 0.2),
                                    bias=False)
    assert layer.weight.device.type == "cuda" and layer.weight.dtype == dtype
    layer.weight.main_grad = torch.zeros(OUT, IN, device=device)
    layer.weight.grad_added_to_main_grad = False
    layer.weight.zero_out_wgrad = False
    gen = torch.Generator().manual_seed(1)
    exact = torch.zeros(OUT, IN, dtype=torch.float64)
    recorder = _Fp32Outputs()
    for _ in range(2):
        x = torch.randn(S, B, IN, generator=gen).to(dtype)
        g = torch.randn(S, B, OUT, generator=gen).to(dtype)
        exact += g.double().reshape(-1, OUT).t() @ x.double().reshape(-1, IN)
        out = layer(x.to(device).requires_grad_())[0]
        with recorder:
            out.backward(g.to(device))
    torch.cuda.synchronize()
    assert not [s for _, s in recorder.shapes if S * B in s or s[:2] == (S, B)], recorder.shapes
    got = layer.weight.main_grad.double().cpu()
    eps = torch.finfo(dtype).eps
    # An fp32-output GEMM adds only fp32 accumulation error; the fallback rounds each product once.
    kernel = wgrad.cuda_wgrad_kernel(device, dtype)
    atol = (1e-4 if kernel else eps) * exact.abs().max().item()
    torch.testing.assert_close(got, exact, rtol=0, atol=atol)
