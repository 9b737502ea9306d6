"""The oldest PyTorch this project runs on, checked when ``megatron`` is imported: one line, no traceback.

PyTorch 2.6 is the floor because the attention core calls
``torch.nn.attention.sdpa_kernel(backends, set_priority=True)`` (new in 2.6; it makes the order of
the kernels of ``--attention-backend`` binding) and ``scaled_dot_product_attention(enable_gqa=...)``
(new in 2.5); checkpoint loading uses ``torch.serialization.safe_globals`` (new in 2.5). The version
is compared on major.minor only, so the pre-release builds of NVIDIA's containers (``2.6.0a0+...``)
pass. A build that reports a new enough version but lacks a feature fails the same way.
"""
import inspect
import re
from typing import List, Tuple

MINIMUM_TORCH = (2, 6)


def _version_tuple(version: str) -> Tuple[int, int]:
    match = re.match(r"\s*(\d+)\.(\d+)", str(version))
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def missing_torch_features(torch_module) -> List[str]:
    """The features of PyTorch >= 2.6 this code calls that ``torch_module`` lacks (empty when none)."""
    missing = []
    try:
        from torch.nn.attention import sdpa_kernel

        if "set_priority" not in inspect.signature(sdpa_kernel).parameters:
            missing.append("torch.nn.attention.sdpa_kernel(set_priority=...)")
    except (ImportError, TypeError, ValueError):
        missing.append("torch.nn.attention.sdpa_kernel")
    sdpa_doc = getattr(torch_module.nn.functional.scaled_dot_product_attention, "__doc__", "") or ""
    if "enable_gqa" not in sdpa_doc:
        missing.append("scaled_dot_product_attention(enable_gqa=...)")
    if not hasattr(torch_module.serialization, "safe_globals"):
        missing.append("torch.serialization.safe_globals")
    return missing


def torch_requirement_error(torch_module) -> str:
    """The one-line error for ``torch_module``, or '' when it is new enough."""
    version = str(torch_module.__version__)
    wanted = ".".join(map(str, MINIMUM_TORCH))
    if _version_tuple(version) < MINIMUM_TORCH:
        return (f"error: megatron-otel needs PyTorch >= {wanted}, found torch {version}; "
                f"install torch>={wanted} (see pyproject.toml)")
    missing = missing_torch_features(torch_module)
    if missing:
        return (f"error: megatron-otel needs PyTorch >= {wanted}; this torch {version} lacks "
                f"{', '.join(missing)}; install torch>={wanted} (see pyproject.toml)")
    return ""


def require_torch() -> None:
    """Exit with the one-line error (status 1, no traceback) when the installed torch is too old.

    Raises:
        SystemExit: carrying the message, which the interpreter prints to stderr.
    """
    import torch

    message = torch_requirement_error(torch)
    if message:
        raise SystemExit(message)
