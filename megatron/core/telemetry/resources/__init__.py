"""Resource detection: local host, SLURM, Kubernetes, NVML GPU identity, and the job's shared ids."""
from __future__ import annotations

from typing import Dict, Mapping, Optional

from .gpu import detect_gpu_identity, gpu_count, physical_gpu_index
from .identity import agree_on_run_id, compute_job_uuids, resolve_run_id, resolve_run_identity, service_instance_id
from .kubernetes import detect_kubernetes_attributes
from .local import detect_local_attributes, package_version
from .slurm import detect_slurm_attributes, slurm_identity_attributes

__all__ = [
    "detect_resource_attributes", "detect_gpu_identity", "gpu_count", "physical_gpu_index",
    "agree_on_run_id", "compute_job_uuids", "resolve_run_id", "resolve_run_identity", "service_instance_id",
    "detect_kubernetes_attributes", "detect_local_attributes", "package_version",
    "detect_slurm_attributes", "slurm_identity_attributes",
]


def detect_resource_attributes(
    local_rank: Optional[int] = None, environ: Optional[Mapping[str, str]] = None, probe_gpus: bool = True
) -> Dict[str, object]:
    """Everything detectable without the training arguments: local, SLURM, Kubernetes, and (when
    ``local_rank`` is given and ``probe_gpus``) this rank's GPU identity. Never raises for missing
    schedulers, drivers or devices: their keys are simply absent."""
    # The identity first: its NVML session also gives the count detect_local_attributes needs.
    identity = detect_gpu_identity(local_rank, environ) if local_rank is not None and probe_gpus else {}
    out = detect_local_attributes(environ, probe_gpus=probe_gpus)
    out.update(detect_slurm_attributes(environ))
    out.update(detect_kubernetes_attributes(environ))
    out.update(identity)
    return out
