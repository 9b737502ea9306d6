"""Telemetry set-up from a TelemetryConfig: SDK check, export decision, resource probe when exporting, log bridge."""
from __future__ import annotations

import importlib.util
import logging
from typing import Any, Callable, Dict

from .config import TelemetryConfig
from .strategies import should_export

__all__ = ["setup_telemetry_from_config", "parallel_rank_attributes"]

logger = logging.getLogger(__name__)

_WARNED_NO_OTEL = False


def parallel_rank_attributes() -> Dict[str, int]:
    """This rank's ``dl.tensor_parallel.rank``, ``dl.pipeline_parallel.rank``, ``dl.data_parallel.rank`` and
    ``dl.context_parallel.rank`` from ``parallel_state`` (empty before ``initialize_model_parallel``), so each
    rank's resource says where it sits in the layout (a slow rank's TP/PP/DP/CP neighbours can then be found
    from its labels)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return {}
    return {
        "dl.tensor_parallel.rank": int(parallel_state.get_tensor_model_parallel_rank()),
        "dl.pipeline_parallel.rank": int(parallel_state.get_pipeline_model_parallel_rank()),
        "dl.data_parallel.rank": int(parallel_state.get_data_parallel_rank()),
        "dl.context_parallel.rank": int(parallel_state.get_context_parallel_rank()),
    }


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


def setup_telemetry_from_config(config: TelemetryConfig, rank: int, world_size: int,
                                resource_attributes: Callable[[], Dict[str, Any]]):
    """Set telemetry up from a validated ``config`` (spec section 1): build the resource attributes
    (``resource_attributes()``, e.g. an NVML probe) only when enabled and this rank exports, call
    ``setup_telemetry``, and start the logging bridge when enabled, logs on, and this rank exports.

    Returns the ``TelemetryHandle``, or ``None`` after one warning when OpenTelemetry cannot be
    imported (training then runs unchanged).
    """
    from .handle import setup_telemetry

    resource_attrs: Dict[str, Any] = {}
    if config.enabled and not _sdk_importable():
        _warn_no_otel("the opentelemetry-sdk package is not installed")
        return None
    if config.enabled and should_export(config, rank, world_size):
        resource_attrs = resource_attributes()
    try:
        handle = setup_telemetry(config, rank, world_size, resource_attrs)
    except ImportError as exc:
        _warn_no_otel(str(exc))
        return None
    if handle.enabled and config.logs_enabled and handle.is_exporting:
        from .logging_bridge import setup_logging_bridge

        setup_logging_bridge(handle)
    return handle
