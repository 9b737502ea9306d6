"""Attributes of the local process and host: host name, pid, GPU count, deployment, version."""
from __future__ import annotations

import os
import socket
from typing import Dict, Mapping, Optional

from .gpu import gpu_count

__all__ = ["detect_local_attributes", "package_version"]


def package_version() -> str:
    """Version of the installed ``megatron`` package (``service.version``)."""
    try:
        from megatron import __version__

        return str(__version__)
    except Exception:
        return "unknown"


def detect_local_attributes(environ: Optional[Mapping[str, str]] = None, probe_gpus: bool = True) -> Dict[str, object]:
    """``host.name``, ``process.pid``, ``host.gpu.count`` (the ``CUDA_VISIBLE_DEVICES``
    entries, else NVML's device count; 0 without a driver),
    ``deployment.environment`` (``DEPLOYMENT_ENV`` or ``ENVIRONMENT``, when set), ``service.version``."""
    env = os.environ if environ is None else environ
    out: Dict[str, object] = {
        "host.name": socket.gethostname(),
        "process.pid": os.getpid(),
        "host.gpu.count": gpu_count(env) if probe_gpus else 0,
    }
    deployment = env.get("DEPLOYMENT_ENV") or env.get("ENVIRONMENT")
    if deployment:
        out["deployment.environment"] = deployment
    out["service.version"] = package_version()
    return out
