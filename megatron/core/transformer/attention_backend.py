"""``--attention-backend``: which SDPA kernels each choice allows, and whether they exist on this machine.

Mapping (``torch.nn.attention.SDPBackend``, in priority order):

- ``flash``   -> FLASH_ATTENTION (FlashAttention-2, Dao 2023; CUDA, compute capability >= 8.0).
- ``fused``   -> CUDNN_ATTENTION, then EFFICIENT_ATTENTION (Rabe & Staats 2021, xFormers). Megatron's
  ``fused`` is Transformer Engine's cuDNN fused attention; the memory-efficient kernel is kept as
  the second choice so shapes cuDNN refuses still run fused instead of failing.
- ``unfused`` -> MATH (explicit softmax(q k^T * scale + mask) v, fp32 intermediates for half inputs).
- ``local``   -> MATH: this project has no attention implementation of its own besides SDPA, so
  Megatron's "local" (its own non-TE unfused attention) is the same math kernel.
- ``auto``    -> no restriction: PyTorch picks (on CPU its tiled flash kernel, on GPUs flash /
  cuDNN / efficient by its own priority).

``flash`` and ``fused`` are refused (``ValueError`` naming the flag and the reason) where the kernel
cannot exist: no CUDA, a PyTorch build without it, or a GPU too old. Shape or dtype limits of a
kernel (e.g. FlashAttention needs fp16/bf16 and head dim <= 256) are only known at call time;
``scaled_dot_product_attention`` then raises "No available kernel" with its reasons.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch.nn.attention import SDPBackend

from megatron.core.transformer.enums import AttnBackend

__all__ = ["as_attn_backend", "sdpa_backends", "attention_backend_unavailable_reason", "check_attention_backend"]

_SDPA_KERNELS = {
    AttnBackend.flash: (SDPBackend.FLASH_ATTENTION,),
    AttnBackend.fused: (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION),
    AttnBackend.unfused: (SDPBackend.MATH,),
    AttnBackend.local: (SDPBackend.MATH,),
    AttnBackend.auto: None,
}
# FlashAttention-2 and cuDNN's fused attention run on Ampere (sm80) and newer in PyTorch's CUDA build.
_MIN_CAPABILITY = (8, 0)


def as_attn_backend(value: Union[str, AttnBackend]) -> AttnBackend:
    """``AttnBackend`` from an enum member or its name (``"flash"``, ...).

    Raises ValueError naming the choices for anything else.
    """
    if isinstance(value, AttnBackend):
        return value
    try:
        return AttnBackend[str(value)]
    except KeyError:
        choices = ", ".join(b.name for b in AttnBackend)
        raise ValueError(f"attention_backend must be one of {choices}, got {value!r}") from None


def sdpa_backends(backend: Union[str, AttnBackend]) -> Optional[Tuple[SDPBackend, ...]]:
    """The SDPA kernels ``backend`` allows, in priority order; None for ``auto`` (no restriction)."""
    return _SDPA_KERNELS[as_attn_backend(backend)]


def _gpu_description() -> Tuple[str, Tuple[int, int]]:
    # No index: both read the current device.
    return torch.cuda.get_device_name(), torch.cuda.get_device_capability()


def attention_backend_unavailable_reason(backend: Union[str, AttnBackend]) -> Optional[str]:
    """Why ``backend``'s kernel cannot run on this machine, or None when it can (always for
    unfused/local/auto). Only build and hardware are checked; no CUDA context is needed beyond
    reading the current device's name and compute capability."""
    backend = as_attn_backend(backend)
    if backend not in (AttnBackend.flash, AttnBackend.fused):
        return None
    kernel = "FlashAttention" if backend is AttnBackend.flash else "fused (cuDNN / memory-efficient) attention"
    if not torch.cuda.is_available():
        return f"{kernel} is a CUDA kernel and CUDA is not available here (torch {torch.__version__})"
    is_rocm = torch.version.hip is not None
    if backend is AttnBackend.flash:
        if not torch.backends.cuda.is_flash_attention_available():
            return f"this PyTorch build (torch {torch.__version__}) was compiled without FlashAttention"
        if not is_rocm:
            name, capability = _gpu_description()
            if capability < _MIN_CAPABILITY:
                return (f"FlashAttention needs compute capability >= {_MIN_CAPABILITY[0]}.{_MIN_CAPABILITY[1]}, "
                        f"GPU {name!r} has {capability[0]}.{capability[1]}")
    # fused: the memory-efficient kernel is part of every CUDA/ROCm build of PyTorch, so with a GPU
    # at least one of its two kernels exists; cuDNN's is used where present.
    return None


def check_attention_backend(backend: Union[str, AttnBackend], flag: str = "--attention-backend") -> AttnBackend:
    """Return ``backend`` as ``AttnBackend``; raise ValueError naming ``flag`` when its kernel is missing."""
    backend = as_attn_backend(backend)
    reason = attention_backend_unavailable_reason(backend)
    if reason is not None:
        raise ValueError(f"{flag} {backend.name} is not available: {reason}; choose unfused, local or auto")
    return backend
