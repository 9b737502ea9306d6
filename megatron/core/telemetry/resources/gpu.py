"""GPU identity of this rank's device through NVML (``pynvml``), absent without error when unavailable."""
from __future__ import annotations

import os
from typing import Dict, Mapping, Optional

__all__ = ["physical_gpu_index", "detect_gpu_identity", "gpu_count"]


def physical_gpu_index(local_rank: int, environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """NVML index of ``local_rank``'s device: ``CUDA_VISIBLE_DEVICES.split(',')[local_rank]`` as an
    int when that variable is set (``None`` when out of range or not an int, e.g. UUID/MIG entries),
    else ``local_rank`` itself."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return int(local_rank)
    entries = [e.strip() for e in visible.split(",")]
    if not 0 <= local_rank < len(entries):
        return None
    try:
        return int(entries[local_rank])
    except ValueError:
        return None


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def detect_gpu_identity(local_rank: int, environ: Optional[Mapping[str, str]] = None) -> Dict[str, object]:
    """``dl.gpu.index/name/uuid`` plus optional ``dl.gpu.serial/pci_bus_id`` for this rank's GPU.

    Returns ``{}`` (never raises) when ``pynvml`` is missing, there is no driver or device, or the
    index cannot be determined.
    """
    index = physical_gpu_index(local_rank, environ)
    if index is None:
        return {}
    try:
        import pynvml
    except Exception:
        return {}
    try:
        pynvml.nvmlInit()
    except Exception:
        return {}
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        out: Dict[str, object] = {
            "dl.gpu.index": index,
            "dl.gpu.name": _text(pynvml.nvmlDeviceGetName(handle)),
            "dl.gpu.uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
        }
        try:
            out["dl.gpu.serial"] = _text(pynvml.nvmlDeviceGetSerial(handle))
        except Exception:
            pass  # consumer boards have no serial number
        try:
            out["dl.gpu.pci_bus_id"] = _text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
        except Exception:
            pass
        return out
    except Exception:
        return {}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def gpu_count() -> int:
    """Number of GPUs NVML sees on this host; 0 when there is no driver or ``pynvml``."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return 0
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
