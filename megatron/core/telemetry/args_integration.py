"""Glue between Megatron's parsed arguments and telemetry: resource attributes, worker bootstrap, setup."""
from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any, Dict, Optional

from .config import TelemetryConfig
from .groups import SpanGroup
from .resources import compute_job_uuids, detect_gpu_identity, slurm_identity_attributes
from .span_groups import MegatronSpanGroup
from .strategies import should_export

__all__ = ["build_telemetry_resource_attrs", "build_otel_worker_bootstrap", "setup_telemetry_from_args",
           "load_config_from_args"]

logger = logging.getLogger(__name__)


def _precision(args) -> str:
    if getattr(args, "fp16", False):
        return "fp16"
    if getattr(args, "bf16", False):
        return "bf16"
    return "fp32"


def _data_parallel_size(args) -> Optional[int]:
    dp = getattr(args, "data_parallel_size", None)
    if dp is not None:
        return int(dp)
    world = getattr(args, "world_size", None)
    if world is None:
        return None
    model_parallel = (int(getattr(args, "tensor_model_parallel_size", 1) or 1)
                      * int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
                      * int(getattr(args, "context_parallel_size", 1) or 1))
    return int(world) // model_parallel


def build_telemetry_resource_attrs(args, local_rank: Optional[int] = None) -> Dict[str, Any]:
    """Resource attributes derived from the training arguments, keys in the order of spec appendix
    A.1: ``dl.local_rank``, parallel sizes, ``dl.batch_size`` (global), ``dl.sequence_length``, the
    ``megatron.*`` model/run settings (skipped when ``None``), ``megatron.precision``, this rank's
    NVML GPU identity, SLURM/NVRx identity, and ``nemo.lens.job_uuid``/``run_uuid``.

    Shared by the training process and the async-checkpoint worker so the two cannot drift.
    ``local_rank`` overrides ``args.local_rank`` (else ``LOCAL_RANK``, else 0). Never raises for a missing optional argument; a missing GPU or driver just omits ``dl.gpu.*``.
    """
    if local_rank is None:
        local_rank = getattr(args, "local_rank", None)
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    attrs: Dict[str, Any] = {"dl.local_rank": int(local_rank)}
    for key, value in (
        ("dl.tensor_parallel.size", getattr(args, "tensor_model_parallel_size", None)),
        ("dl.pipeline_parallel.size", getattr(args, "pipeline_model_parallel_size", None)),
        ("dl.data_parallel.size", _data_parallel_size(args)),
        ("dl.batch_size", getattr(args, "global_batch_size", None)),
        ("dl.sequence_length", getattr(args, "seq_length", None)),
    ):
        if value is not None:
            attrs[key] = int(value)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "train_iters", "micro_batch_size", "ckpt_format"):
        value = getattr(args, name, None)
        if value is not None:
            attrs[f"megatron.{name}"] = value if isinstance(value, (bool, int, float, str)) else str(value)
    attrs["megatron.precision"] = _precision(args)
    attrs.update(detect_gpu_identity(int(local_rank)))
    attrs.update(slurm_identity_attributes())
    job_uuid, run_uuid = compute_job_uuids()
    attrs["nemo.lens.job_uuid"] = job_uuid
    attrs["nemo.lens.run_uuid"] = run_uuid
    return attrs


def parallel_rank_attributes() -> Dict[str, int]:
    """This rank's ``dl.tensor_parallel.rank``, ``dl.pipeline_parallel.rank`` and ``dl.data_parallel.rank``
    from ``parallel_state`` (empty before ``initialize_model_parallel``), so each rank's resource says
    where it sits in the layout (a slow rank's TP/PP/DP neighbours can then be found from its labels)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return {}
    return {
        "dl.tensor_parallel.rank": int(parallel_state.get_tensor_model_parallel_rank()),
        "dl.pipeline_parallel.rank": int(parallel_state.get_pipeline_model_parallel_rank()),
        "dl.data_parallel.rank": int(parallel_state.get_data_parallel_rank()),
    }


def build_otel_worker_bootstrap(args) -> Dict[str, Any]:
    """Plain, picklable dict from which a persistent async-checkpoint worker rebuilds the same
    telemetry identity (spec appendix A.2): ``enabled``, ``service_name``, ``span_groups`` (only
    base-``SpanGroup`` names, ``default`` if none remain, ``per_step`` if the spec cannot be
    resolved), ``resolved_span_groups`` (sorted, or ``None``), ``rank``, ``world_size`` and
    ``resource_attrs`` (empty when disabled)."""
    enabled = bool(getattr(args, "otel_enabled", False))
    service_name = getattr(args, "otel_service_name", None)
    if not service_name:
        service_name = "megatron-lm" if not os.environ.get("OTEL_SERVICE_NAME") else None
    spec = getattr(args, "otel_span_groups", None)
    if spec is None:
        spec = (os.environ.get("MEGATRON_OTEL_SPAN_GROUPS", "").strip()
                or os.environ.get("NEMO_LENS_SPAN_GROUPS", "").strip() or "default")
    try:
        resolved = MegatronSpanGroup.resolve(spec)
        base = sorted(resolved & SpanGroup.groups())
        span_groups = ",".join(base) if base else "default"
        resolved_list = sorted(resolved)
    except Exception:
        span_groups, resolved_list = "per_step", None
    return {
        "enabled": enabled,
        "service_name": service_name,
        "span_groups": span_groups,
        "resolved_span_groups": resolved_list,
        "rank": getattr(args, "rank", None),
        "world_size": getattr(args, "world_size", None),
        "resource_attrs": build_telemetry_resource_attrs(args) if enabled else {},
    }


def load_config_from_args(args) -> TelemetryConfig:
    """``TelemetryConfig.from_env(MEGATRON_OTEL, fallback NEMO_LENS)`` with the CLI overrides
    ``--otel-enabled`` (only turns on), ``--otel-service-name`` and ``--otel-span-groups``, validated.
    Raises ``ValueError`` naming the variable or flag for any bad value."""
    config = TelemetryConfig.from_env(prefix="MEGATRON_OTEL", fallback_prefix="NEMO_LENS",
                                      span_group_cls=MegatronSpanGroup)
    config = config.with_overrides(
        enabled=True if getattr(args, "otel_enabled", False) else None,
        service_name=getattr(args, "otel_service_name", None),
        span_groups=getattr(args, "otel_span_groups", None),
    )
    return config.validate()


_WARNED_NO_OTEL = False


def _sdk_importable() -> bool:
    try:  # find_spec imports the parent package, which raises when it is missing altogether
        return importlib.util.find_spec("opentelemetry.sdk") is not None
    except (ImportError, ValueError):
        return False


def _warn_no_otel(reason: str) -> None:
    global _WARNED_NO_OTEL
    if not _WARNED_NO_OTEL:
        logger.warning("OpenTelemetry cannot be imported (%s); telemetry is off and training runs unchanged", reason)
        _WARNED_NO_OTEL = True


def setup_telemetry_from_args(args, rank: int, world_size: int, local_rank: Optional[int] = None):
    """What ``global_vars.set_telemetry()`` does (spec section 1): load and validate the config on
    every rank (``ValueError`` on bad settings, before any model is built), build resource attributes
    only when enabled and this rank exports (no NVML probe otherwise), call ``setup_telemetry``, and
    start the logging bridge when enabled, logs on, and this rank exports.

    Returns the ``TelemetryHandle``, or ``None`` after one warning when OpenTelemetry cannot be
    imported (training then runs unchanged).
    """
    from .handle import setup_telemetry

    config = load_config_from_args(args)
    resource_attrs: Dict[str, Any] = {}
    if config.enabled and not _sdk_importable():
        _warn_no_otel("the opentelemetry-sdk package is not installed")
        return None
    if config.enabled and should_export(config, rank, world_size):
        resource_attrs = build_telemetry_resource_attrs(args, local_rank=local_rank)
        resource_attrs.update(parallel_rank_attributes())
    try:
        handle = setup_telemetry(config, rank, world_size, resource_attrs)
    except ImportError as exc:
        _warn_no_otel(str(exc))
        return None
    if handle.enabled and config.logs_enabled and handle.is_exporting:
        from .logging_bridge import setup_logging_bridge

        setup_logging_bridge(handle)
    return handle
