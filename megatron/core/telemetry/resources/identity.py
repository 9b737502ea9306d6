"""Job identity shared by every rank: run id, launch uuid, ``nemo.lens.job_uuid`` and ``nemo.lens.run_uuid``."""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import uuid
from typing import Mapping, Optional, Tuple

__all__ = ["compute_job_uuids", "resolve_run_id", "resolve_run_identity", "service_instance_id", "agree_on_run_id"]

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


def _collective_ready(world_size: int, allow_collective: bool) -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(allow_collective and world_size > 1 and dist is not None and dist.is_available()
                and dist.is_initialized())


def resolve_run_identity(
    explicit: Optional[str] = None,
    world_size: int = 1,
    environ: Optional[Mapping[str, str]] = None,
    allow_collective: bool = True,
) -> Tuple[str, str]:
    """``(run_id, launch_uuid)``, both identical on every rank of one launch (spec section 5).

    ``launch_uuid`` (32 hex characters) is new for every launch, restart and requeue: rank 0 draws a
    uuid4 and broadcasts it once when ``torch.distributed`` is initialised with more than one rank
    (then every rank must call this); a single process draws its own. Per-iteration trace ids are
    derived from it (``distributed.iteration_span_ids``), so two launches never share a trace even
    when they share a run id (a SLURM requeue keeps ``SLURM_JOB_ID``; a user may reuse an explicit id).

    Run id order: ``explicit`` (``MEGATRON_OTEL_RUN_ID``/``NEMO_LENS_RUN_ID``, kept as given),
    ``SLURM_JOB_ID``, a 12-character hash of ``TORCHELASTIC_RUN_ID`` (when not torchrun's placeholder
    ``none``), else the first 12 characters of ``launch_uuid``: unique per launch, unlike launcher
    state such as ``MASTER_ADDR``/``MASTER_PORT`` that two launches on one host share.

    Only without an initialised process group and with more than one rank can ranks not agree on a
    fresh value; then both fall back to a hash of the launcher's rendezvous state and the restart
    counters (one warning: that id repeats when the same address and port are reused).
    """
    env = os.environ if environ is None else environ
    if _collective_ready(world_size, allow_collective):
        launch = agree_on_run_id(uuid.uuid4().hex)
    elif world_size > 1:
        addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        logger.warning("telemetry set up before the process group exists: the %d ranks cannot agree on a "
                       "per-launch id, so trace ids repeat when a launch reuses MASTER_ADDR/MASTER_PORT "
                       "(set it up after torch.distributed.init_process_group)", world_size)
        _, run_uuid = compute_job_uuids(env)
        launch = hashlib.sha256(
            f"launcher/{addr}:{port}/{env.get('WORLD_SIZE', world_size)}/{run_uuid}".encode()).hexdigest()[:32]
    else:
        launch = uuid.uuid4().hex
    if explicit and explicit.strip():
        return explicit.strip(), launch
    slurm = (env.get("SLURM_JOB_ID") or "").strip()
    if slurm:
        return slurm, launch
    elastic = (env.get("TORCHELASTIC_RUN_ID") or "").strip()
    if elastic and elastic.lower() != "none":
        return _short_hash("torchelastic/" + elastic), launch
    return launch[:RUN_ID_LENGTH], launch


def resolve_run_id(
    explicit: Optional[str] = None,
    world_size: int = 1,
    environ: Optional[Mapping[str, str]] = None,
    allow_collective: bool = True,
) -> str:
    """The run id of ``resolve_run_identity`` (same rules, same collective: call it on every rank)."""
    return resolve_run_identity(explicit, world_size, environ, allow_collective)[0]


def service_instance_id(run_id: str, rank: int) -> str:
    """``service.instance.id`` of one rank: ``"{run_id}-rank{rank}"``."""
    return f"{run_id}-rank{int(rank)}"
