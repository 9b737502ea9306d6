"""SLURM job attributes, read from the ``SLURM_*`` variables the scheduler sets."""
from __future__ import annotations

import os
from typing import Dict, Mapping, Optional

__all__ = ["detect_slurm_attributes", "slurm_identity_attributes"]

_DETECTED = (
    ("slurm.job.id", "SLURM_JOB_ID"),
    ("slurm.job.name", "SLURM_JOB_NAME"),
    ("slurm.nodelist", "SLURM_JOB_NODELIST"),
    ("slurm.nnodes", "SLURM_JOB_NUM_NODES"),
    ("slurm.ntasks", "SLURM_NTASKS"),
    ("slurm.partition", "SLURM_JOB_PARTITION"),
    ("slurm.cluster.name", "SLURM_CLUSTER_NAME"),
    ("slurm.array.job_id", "SLURM_ARRAY_JOB_ID"),
    ("slurm.array.task_id", "SLURM_ARRAY_TASK_ID"),
    ("slurm.restart_count", "SLURM_RESTART_COUNT"),
)
# Older SLURM releases and some sites only set the short spellings.
_ALIASES = {"SLURM_JOB_NODELIST": "SLURM_NODELIST", "SLURM_JOB_NUM_NODES": "SLURM_NNODES",
            "SLURM_JOB_PARTITION": "SLURM_PARTITION"}

_IDENTITY = (
    ("slurm.job.id", "SLURM_JOB_ID"),
    ("slurm.sluid", "LENS_SLURM_SLUID"),
    ("slurm.cluster", "SLURM_CLUSTER_NAME"),
    ("slurm.array.job_id", "SLURM_ARRAY_JOB_ID"),
    ("slurm.array.task_id", "SLURM_ARRAY_TASK_ID"),
    ("slurm.array.sluid", "LENS_SLURM_ARRAY_SLUID"),
    ("slurm.restart_count", "SLURM_RESTART_COUNT"),
    ("nvrx.cycle", "NVRX_CYCLE"),
    ("nvrx.infra_rank", "NVRX_INFRA_RANK"),
    ("nvrx.membership", "NVRX_MEMBERSHIP"),
)


def detect_slurm_attributes(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Section-5 SLURM resource attributes; empty unless ``SLURM_JOB_ID`` is set. Values are
    strings as SLURM sets them; unset or empty variables are left out."""
    env = os.environ if environ is None else environ
    if not env.get("SLURM_JOB_ID"):
        return {}
    out = {}
    for key, var in _DETECTED:
        value = env.get(var) or env.get(_ALIASES.get(var, ""), "")
        if value:
            out[key] = value
    return out


def slurm_identity_attributes(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Appendix-A.1 SLURM/NVRx identity keys (only non-empty values), then
    ``slurm.torchelastic.restart_count`` when ``TORCHELASTIC_RESTART_COUNT`` is set."""
    env = os.environ if environ is None else environ
    out = {key: env[var] for key, var in _IDENTITY if env.get(var)}
    if env.get("TORCHELASTIC_RESTART_COUNT") is not None:
        out["slurm.torchelastic.restart_count"] = env["TORCHELASTIC_RESTART_COUNT"]
    return out
