"""Accumulate a linear layer's weight gradient into ``main_grad`` without fp32 copies of its inputs.

With bf16/fp16 parameters and an fp32 gradient buffer (Megatron's ``--accumulate-allreduce-grads-in-fp32``),
the weight gradient ``dW = dYᵀ X`` of a ``[tokens, in] -> [tokens, out]`` linear is summed over
micro-batches in fp32. Upcasting ``dY`` and ``X`` first would copy two ``[tokens, hidden]`` activations
to fp32 per layer and micro-batch and run the GEMM in fp32/TF32, for no precision gain: bf16 values
are exact in fp32 and a bf16 GEMM already accumulates its products in fp32. The GEMM here reads the
low-precision operands directly:

- CUDA, where cuBLAS can write an fp32 result from bf16/fp16 operands (``torch.addmm(..., out_dtype=)``):
  ``main_grad += dYᵀ X`` in one GEMM with ``beta = 1``, no rounding of the product;
- CUDA with only ``torch.mm(..., out_dtype=)``: an fp32 ``[out, in]`` product, then ``main_grad.add_``;
- otherwise (CPU, older CUDA builds): a low-precision GEMM (fp32 accumulation, output rounded to
  bf16/fp16), then ``main_grad.add_``. This is exactly what the unfused path does (autograd's bf16
  ``weight.grad`` added into ``main_grad`` by the DDP hook), so it agrees with the CUDA paths within
  one bf16 rounding of each micro-batch's product.

Same-dtype operands and buffer (fp32 training, or a bf16 buffer) keep the plain ``main_grad.addmm_``.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

_LOW_PRECISION = (torch.bfloat16, torch.float16)

# Per process and device type: which CUDA kernel wrote a correct fp32 product on first use.
_cuda_kernel: Dict[str, Optional[str]] = {}


def _has_cuda_kernel(op_name: str) -> bool:
    # Feature detection, not a version check: is a CUDA kernel registered for this overload?
    has_kernel = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    return bool(has_kernel and has_kernel(op_name, "CUDA"))


def _probe_cuda_kernel(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """'addmm' or 'mm' if that out_dtype=fp32 kernel runs and gives the fp32 product on ``device``, else None.

    Some releases register the kernels but refuse an fp32 accumulator next to bf16 operands, so the
    choice is made by running each candidate once on a small problem and checking its numbers.
    """
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(16, 32, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(32, 8, generator=generator).to(device=device, dtype=dtype)
    start = torch.randn(16, 8, generator=generator).to(device)
    want = start + a.float() @ b.float()
    if _has_cuda_kernel("aten::addmm.dtype_out"):
        try:
            acc = start.clone()
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            if torch.allclose(acc, want, rtol=1e-4, atol=1e-4):
                return "addmm"
        except (RuntimeError, TypeError):
            pass
    if _has_cuda_kernel("aten::mm.dtype"):
        try:
            if torch.allclose(start + torch.mm(a, b, out_dtype=torch.float32), want, rtol=1e-4, atol=1e-4):
                return "mm"
        except (RuntimeError, TypeError):
            pass
    return None


def cuda_wgrad_kernel(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """The fp32-output kernel used for ``dtype`` operands on CUDA ``device`` ('addmm', 'mm' or None), cached."""
    key = f"{device.type}:{dtype}"
    if key not in _cuda_kernel:
        _cuda_kernel[key] = _probe_cuda_kernel(device, dtype)
    return _cuda_kernel[key]


def accumulate_weight_grad(main_grad: torch.Tensor, grad_output_2d: torch.Tensor,
                           total_input_2d: torch.Tensor) -> None:
    """``main_grad [out, in] += grad_output_2dᵀ [out, tokens] @ total_input_2d [tokens, in]``, in place.

    Low-precision operands with an fp32 ``main_grad`` are never upcast (see the module docstring);
    any other dtype mix (e.g. fp32 operands and buffer) uses ``main_grad.addmm_`` on operands cast
    to the buffer's dtype, which is a no-op cast when they already match.
    """
    grad_output_t = grad_output_2d.t()
    dtype = total_input_2d.dtype
    low_precision_into_fp32 = (main_grad.dtype == torch.float32 and dtype in _LOW_PRECISION
                               and grad_output_2d.dtype == dtype)
    if not low_precision_into_fp32:
        main_grad.addmm_(grad_output_t.to(main_grad.dtype), total_input_2d.to(main_grad.dtype))
        return
    kernel = cuda_wgrad_kernel(main_grad.device, dtype) if main_grad.is_cuda else None
    if kernel == "addmm":
        torch.addmm(main_grad, grad_output_t, total_input_2d, out_dtype=torch.float32, out=main_grad)
    elif kernel == "mm":
        main_grad.add_(torch.mm(grad_output_t, total_input_2d, out_dtype=torch.float32))
    else:
        main_grad.add_(torch.mm(grad_output_t, total_input_2d))
