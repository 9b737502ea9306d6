"""GPU identity of this rank's device through NVML (``pynvml``), absent without error when unavailable."""
from __future__ import annotations

import os
from typing import Dict, Mapping, Optional, Tuple

__all__ = ["physical_gpu_index", "detect_gpu_identity", "gpu_count", "reset_nvml_probe"]


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


# One NVML session per process and device index: the exporting rank needs the GPU count and its
# device's identity in several places (resource detection, training-argument attributes), and
# nvmlInit is slow (tens of ms), so the first probe answers them all. Keyed by pid too: a forked
# child probes for itself.
_PROBES: Dict[Tuple[int, Optional[int]], Tuple[int, Dict[str, object]]] = {}


def reset_nvml_probe() -> None:
    """Forget this process's NVML probes (tests that swap ``pynvml``; a changed device set)."""
    _PROBES.clear()


def _probe(index: Optional[int]) -> Tuple[int, Dict[str, object]]:
    """``(device count, identity of device index)`` from one NVML session (``(0, {})`` without
    ``pynvml`` or a driver); the identity is ``{}`` when ``index`` is ``None`` or unknown."""
    key = (os.getpid(), index)
    if key in _PROBES:
        return _PROBES[key]
    result: Tuple[int, Dict[str, object]] = (0, {})
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        _PROBES[key] = result
        return result
    try:
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        except Exception:
            count = 0
        result = (count, _identity(pynvml, index) if index is not None else {})
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    _PROBES[key] = result
    return result


def _identity(pynvml, index: int) -> Dict[str, object]:
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        out: Dict[str, object] = {
            "dl.gpu.index": index,
            "dl.gpu.name": _text(pynvml.nvmlDeviceGetName(handle)),
            "dl.gpu.uuid": _text(pynvml.nvmlDeviceGetUUID(handle)),
        }
    except Exception:
        return {}
    try:
        out["dl.gpu.serial"] = _text(pynvml.nvmlDeviceGetSerial(handle))
    except Exception:
        pass  # consumer boards have no serial number
    try:
        out["dl.gpu.pci_bus_id"] = _text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
    except Exception:
        pass
    return out


def detect_gpu_identity(local_rank: int, environ: Optional[Mapping[str, str]] = None) -> Dict[str, object]:
    """``dl.gpu.index/name/uuid`` plus optional ``dl.gpu.serial/pci_bus_id`` for this rank's GPU.

    Returns ``{}`` (never raises) when ``pynvml`` is missing, there is no driver or device, or the
    index cannot be determined. NVML is probed once per process and device (``_probe``).
    """
    index = physical_gpu_index(local_rank, environ)
    if index is None:
        return {}
    return dict(_probe(index)[1])


def gpu_count(environ: Optional[Mapping[str, str]] = None) -> int:
    """GPUs this process can use: the entries of ``CUDA_VISIBLE_DEVICES`` when it is set (blank: 0),
    as nemo-lens counts them; else the devices NVML sees on the host (0 without a driver or
    ``pynvml``), reusing this process's earlier NVML probe when there is one."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([entry for entry in visible.split(",") if entry.strip()])
    pid = os.getpid()
    for (probe_pid, _), (count, _) in _PROBES.items():
        if probe_pid == pid:
            return count
    return _probe(None)[0]
