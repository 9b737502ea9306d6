"""OpenTelemetry traces, metrics and logs for Megatron training that cost nothing when off.

Importable without the OpenTelemetry packages: only ``providers`` imports the SDK, and only on a
rank that exports. Layers, each importing only earlier ones: ``groups``/``span_groups``, ``otlp_env``,
``strategies``, ``providers``, ``sampling``, ``config``, ``resources``, ``handle``; instrumented code uses ``helpers``.
"""
from .config import NemoLensConfig, TelemetryConfig, otlp_protocol, parse_bool
from .distributed import (
    broadcast_trace_context,
    create_linked_span,
    iteration_sampled,
    iteration_span_ids,
    iteration_step_span,
    iteration_trace_context,
)
from .groups import SpanGroup
from .handle import TelemetryHandle, get_active_handle, setup_telemetry
from .helpers import (
    is_span_group_enabled,
    managed_span,
    redact_value,
    safe_set_span_attributes,
    sanitize_attributes,
    span_cm,
    trace_fn,
    trace_region,
)
from .logging_bridge import setup_logging_bridge, teardown_logging_bridge
from .propagation import extract_context, inject_context
from .resources import compute_job_uuids, detect_resource_attributes, resolve_run_id, resolve_run_identity
from .sampling import register_sampling_strategy, registered_sampling_strategies, unregister_sampling_strategy
from .setup import parallel_rank_attributes, setup_telemetry_from_config
from .span_groups import MegatronSpanGroup
from .state import get_enabled_groups, get_pipeline_carrier, set_enabled_groups, set_pipeline_carrier
from .strategies import (
    register_export_strategy,
    register_rank_strategy,
    registered_rank_strategies,
    should_export,
    unregister_rank_strategy,
)
from .training_metrics import TRAINING_INSTRUMENTS, record_training_metrics

__all__ = [
    "TelemetryConfig", "NemoLensConfig", "parse_bool", "otlp_protocol", "SpanGroup", "MegatronSpanGroup",
    "setup_telemetry", "TelemetryHandle", "get_active_handle",
    "managed_span", "span_cm", "trace_fn", "trace_region", "safe_set_span_attributes", "sanitize_attributes",
    "redact_value",
    "is_span_group_enabled", "get_enabled_groups", "set_enabled_groups",
    "inject_context", "extract_context", "broadcast_trace_context", "create_linked_span",
    "iteration_trace_context", "iteration_span_ids", "iteration_sampled", "iteration_step_span",
    "get_pipeline_carrier", "set_pipeline_carrier",
    "setup_logging_bridge", "teardown_logging_bridge", "record_training_metrics", "TRAINING_INSTRUMENTS",
    "register_rank_strategy", "register_export_strategy", "unregister_rank_strategy", "registered_rank_strategies",
    "should_export", "register_sampling_strategy", "unregister_sampling_strategy", "registered_sampling_strategies",
    "compute_job_uuids", "detect_resource_attributes", "resolve_run_id", "resolve_run_identity",
    "setup_telemetry_from_config", "parallel_rank_attributes",
]
