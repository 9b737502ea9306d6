"""Benchmark: fused weight-grad accumulation into an fp32 main_grad, old fp32-upcast path vs the low-precision path.

Run ``python bench/bench_wgrad.py [--tokens T] [--hidden H] [--dtype bf16|fp16] [--device cpu|cuda]``.
Both paths compute ``main_grad [4H, H] += dYᵀ [4H, T] @ X [T, H]`` (an MLP fc1's wgrad) in one process:
"old" upcasts dY and X to fp32 first (two fp32 [T, x] copies, an fp32 GEMM); "new" is
``accumulate_weight_grad`` (no copy; fp32-output GEMM on CUDA, low-precision GEMM + add elsewhere).
Prints ms per call (best of R repeats), the old/new ratio, the bytes of fp32 copies the old path
makes, and the max |difference| of the two results relative to max |main_grad|.
The win is on GPUs (bf16 tensor cores, no copies). A CPU without native bf16 GEMMs runs the bf16
GEMM slower than an fp32 one, so there the ratio is below 1 (the unfused bf16 path pays the same).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.core.tensor_parallel.wgrad import accumulate_weight_grad, cuda_wgrad_kernel  # noqa: E402


def _old(main_grad, grad_output_2d, total_input_2d):
    main_grad.addmm_(grad_output_2d.t().to(torch.float32), total_input_2d.to(torch.float32))


def _best_ms(fn, args, calls, repeats, device):
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    fn(*args)  # warm-up (and, on CUDA, the one-off kernel probe)
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        sync()
        best = min(best, (time.perf_counter() - start) / calls * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per micro-batch (s*b)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    gen = torch.Generator().manual_seed(0)
    out_features = 4 * args.hidden
    grad_output = torch.randn(args.tokens, out_features, generator=gen).to(device=device, dtype=dtype)
    total_input = torch.randn(args.tokens, args.hidden, generator=gen).to(device=device, dtype=dtype)
    main_old = torch.zeros(out_features, args.hidden, device=device)
    main_new = torch.zeros_like(main_old)

    old_ms = _best_ms(_old, (main_old, grad_output, total_input), args.calls, args.repeats, device)
    new_ms = _best_ms(accumulate_weight_grad, (main_new, grad_output, total_input), args.calls, args.repeats, device)
    kernel = cuda_wgrad_kernel(device, dtype) if device.type == "cuda" else None
    copy_bytes = 4 * args.tokens * (out_features + args.hidden)
    rel_diff = ((main_old - main_new).abs().max() / main_old.abs().max()).item()
    print(f"device={device} dtype={args.dtype} tokens={args.tokens} hidden={args.hidden} "
          f"new_kernel={kernel or 'low-precision GEMM + add'}")
    print(f"old fp32-upcast wgrad ms/call      {old_ms:.3f}")
    print(f"new low-precision wgrad ms/call    {new_ms:.3f}")
    print(f"speed-up old/new                   {old_ms / new_ms:.2f}")
    print(f"fp32 copies avoided per call (MB)  {copy_bytes / 1e6:.1f}")
    print(f"max |old - new| / max |main_grad|  {rel_diff:.2e}")


if __name__ == "__main__":
    main()
