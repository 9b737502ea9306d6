"""Compile a chain of element-wise ops into one kernel on CUDA; run it op by op elsewhere.

Megatron-LM fuses bias+GeLU and bias+dropout+add with TorchScript; here the same math is a plain
PyTorch function that :func:`fuse_pointwise` hands to ``torch.compile`` (inductor emits one Triton
kernel per chain, forward and backward) when its tensors are on a CUDA device. On the CPU, and inside
a region that is already being compiled (``--compile-transformer-layers``, whose own graph fuses the
chain), the function runs eagerly: same ops, same numbers, no compiler start-up.
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch


def compiles_on(tensor: torch.Tensor) -> bool:
    """Whether element-wise chains on ``tensor``'s device are compiled (CUDA: inductor emits Triton kernels)."""
    return tensor.is_cuda


def fuse_pointwise(fn: Callable) -> Callable:
    """``fn`` whose first tensor argument decides: CUDA -> ``torch.compile(fn)`` (built on first use), else ``fn``.

    If the compiler cannot build the kernel (e.g. no Triton in this environment), a warning names the
    function once and it runs eagerly from then on.
    """
    compiled = None
    failed = False

    @functools.wraps(fn)
    def run(first: torch.Tensor, *args, **kwargs):
        nonlocal compiled, failed
        if failed or torch.compiler.is_compiling() or not compiles_on(first):
            return fn(first, *args, **kwargs)
        if compiled is None:
            # dynamic=None: a second shape (the last, shorter micro-batch) makes the kernel shape-generic.
            compiled = torch.compile(fn, fullgraph=True)
        try:
            return compiled(first, *args, **kwargs)
        except Exception as error:  # noqa: BLE001 - any compiler failure falls back to the eager ops
            failed = True
            warnings.warn(f"{fn.__name__}: torch.compile could not fuse the element-wise ops ({error!r:.200}); "
                          "running them unfused")
            return fn(first, *args, **kwargs)

    run.unfused = fn
    return run
