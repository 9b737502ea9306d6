"""Job identity shared by every rank: run id, ``nemo.lens.job_uuid`` and ``nemo.lens.run_uuid``."""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import uuid
from typing import Mapping, Optional, Tuple

__all__ = ["compute_job_uuids", "resolve_run_id", "service_instance_id", "agree_on_run_id"]

logger = logging.getLogger(__name__)
RUN_ID_LENGTH = 12


def compute_job_uuids(environ: Optional[Mapping[str, str]] = None) -> Tuple[str, str]:
    """``(job_uuid, run_uuid)`` as uuid5 strings derived from SLURM/torchelastic variables only.

    ``job_uuid`` is stable across restarts and requeues of one job; ``run_uuid`` changes with
    ``SLURM_RESTART_COUNT`` (non-array jobs) and ``TORCHELASTIC_RESTART_COUNT``. No communication:
    every rank and every checkpoint worker computes the same values (spec appendix A.1).
    """
    env = os.environ if environ is None else environ
    cluster = env.get("SLURM_CLUSTER_NAME") or "nocluster"
    is_array = env.get("SLURM_ARRAY_TASK_ID") is not None
    job_key = (env.get("SLURM_ARRAY_JOB_ID") if is_array else None) or env.get("SLURM_JOB_ID") or "nojob"
    run_parts = [cluster, job_key]
    if not is_array:
        run_parts.append("sr" + (env.get("SLURM_RESTART_COUNT") or "0"))
    if env.get("TORCHELASTIC_RESTART_COUNT") is not None:
        run_parts.append("te" + env["TORCHELASTIC_RESTART_COUNT"])
    job_uuid = uuid.uuid5(uuid.NAMESPACE_URL, f"nemo.lens.job/{cluster}/{job_key}")
    run_uuid = uuid.uuid5(uuid.NAMESPACE_URL, "nemo.lens.run/" + "/".join(run_parts))
    return str(job_uuid), str(run_uuid)


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:RUN_ID_LENGTH]


def agree_on_run_id(proposal: str, group=None) -> str:
    """Broadcast rank 0's ``proposal`` (<= 64 ASCII chars) so every rank returns the same run id.

    One small collective; call it on every rank of ``group`` (default: the world). The tensor lives
    where the group's backend needs it (``megatron.core.collective_device``: CUDA under NCCL).
    """
    import torch
    import torch.distributed as dist

    # Imported here: telemetry stays importable without torch.
    from megatron.core.collective_device import get_collective_device

    device = get_collective_device(group)
    payload = proposal.encode("ascii")[:64].ljust(64, b"\0")
    buf = torch.tensor(list(payload), dtype=torch.uint8, device=device)
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast(buf, src=src, group=group)
    return bytes(buf.cpu().tolist()).rstrip(b"\0").decode("ascii")


def resolve_run_id(
    explicit: Optional[str] = None,
    world_size: int = 1,
    environ: Optional[Mapping[str, str]] = None,
    allow_collective: bool = True,
) -> str:
    """The run id, identical on every rank of a job (spec section 5).

    Order: ``explicit`` (``MEGATRON_OTEL_RUN_ID``/``NEMO_LENS_RUN_ID``), ``SLURM_JOB_ID``, a
    12-character hash of ``TORCHELASTIC_RUN_ID`` (when not torchrun's placeholder ``none``), one
    broadcast from rank 0 when ``torch.distributed`` is already initialised with more than one rank
    (all ranks must call this then), a hash of the launcher's shared rendezvous state
    (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``), and finally a random id for one process.
    """
    env = os.environ if environ is None else environ
    if explicit and explicit.strip():
        return explicit.strip()
    slurm = (env.get("SLURM_JOB_ID") or "").strip()
    if slurm:
        return slurm
    elastic = (env.get("TORCHELASTIC_RUN_ID") or "").strip()
    if elastic and elastic.lower() != "none":
        return _short_hash("torchelastic/" + elastic)
    dist = sys.modules.get("torch.distributed")
    if allow_collective and world_size > 1 and dist is not None and dist.is_available() and dist.is_initialized():
        return agree_on_run_id(uuid.uuid4().hex[:RUN_ID_LENGTH])
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if world_size > 1:
        if addr and port:
            return _short_hash(f"launcher/{addr}:{port}/{env.get('WORLD_SIZE', world_size)}")
        logger.warning("no SLURM, torchelastic or MASTER_ADDR/MASTER_PORT state to derive a shared run id from; "
                       "set MEGATRON_OTEL_RUN_ID so all %d ranks agree", world_size)
    return uuid.uuid4().hex[:RUN_ID_LENGTH]


def service_instance_id(run_id: str, rank: int) -> str:
    """``service.instance.id`` of one rank: ``"{run_id}-rank{rank}"``."""
    return f"{run_id}-rank{int(rank)}"
