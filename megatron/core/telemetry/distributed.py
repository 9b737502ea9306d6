"""Pipeline-parallel trace correlation: one trace per iteration across stages (spec section 7)."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, Mapping, Optional, Tuple

from . import state as _state
from .helpers import _LiveSpanCM, _NULL_SPAN_CM
from .propagation import extract_context, inject_context

__all__ = ["iteration_span_ids", "iteration_sampled", "iteration_trace_context", "broadcast_trace_context",
           "create_linked_span", "CARRIER_BYTES"]

CARRIER_BYTES = 256
_TRACE_ID_LIMIT = (1 << 64) - 1


def iteration_span_ids(run_id: str, iteration: int, launch_uuid: Optional[str] = None) -> Tuple[int, int]:
    """``(trace_id, parent_span_id)`` of ``iteration``: the first 16 and next 8 bytes of
    SHA-256(``megatron.trace/{run_id}/{launch_uuid}/{iteration}``), or of
    ``megatron.trace/{run_id}/{iteration}`` without a launch uuid. Every stage computes the same pair
    without communicating, because run id and launch uuid are shared (resources.identity); the launch
    uuid (``TelemetryHandle.launch_uuid``) keeps a restart or requeue that reuses the run id from
    reusing its trace ids."""
    key = f"{run_id}/{launch_uuid}" if launch_uuid else f"{run_id}"
    digest = hashlib.sha256(f"megatron.trace/{key}/{int(iteration)}".encode()).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:24], "big") or 1
    return trace_id, span_id


def iteration_sampled(trace_id: int, environ: Optional[Mapping[str, str]] = None) -> bool:
    """The keep/drop decision ``OTEL_TRACES_SAMPLER`` would make for a new root with ``trace_id``.

    Ratio samplers decide from the low 64 bits of the trace id against ``round(rate * 2**64)``
    (the OpenTelemetry ``TraceIdRatioBased`` rule), so every stage reaches the same decision.
    """
    env = os.environ if environ is None else environ
    name = (env.get("OTEL_TRACES_SAMPLER") or "parentbased_always_on").strip().lower()
    if name in ("always_off", "parentbased_always_off"):
        return False
    if name in ("traceidratio", "parentbased_traceidratio"):
        try:
            rate = float(env.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))
        except ValueError:
            rate = 1.0
        rate = min(max(rate, 0.0), 1.0)
        return (trace_id & _TRACE_ID_LIMIT) < round(rate * (_TRACE_ID_LIMIT + 1))
    return True


def iteration_trace_context(run_id: str, iteration: int, sampled: Optional[bool] = None,
                            launch_uuid: Optional[str] = None):
    """An OpenTelemetry Context whose (remote, never exported) parent span is derived from
    ``run_id``, ``launch_uuid`` and ``iteration`` (``iteration_span_ids``): pass it as ``context=`` to the step span on every pipeline stage
    and all stages' spans of that iteration land in one trace, with zero communication.

    ``sampled`` defaults to ``iteration_sampled`` so ratio sampling stays consistent across stages.
    Returns ``None`` when OpenTelemetry is not installed.
    """
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    trace_id, span_id = iteration_span_ids(run_id, iteration, launch_uuid)
    if sampled is None:
        sampled = iteration_sampled(trace_id)
    span_context = trace.SpanContext(
        trace_id=trace_id, span_id=span_id, is_remote=True,
        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED if sampled else trace.TraceFlags.DEFAULT),
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context))


def _fresh_traceparent() -> str:
    raw = os.urandom(24)
    trace_id = int.from_bytes(raw[:16], "big") or 1
    span_id = int.from_bytes(raw[16:], "big") or 1
    return f"00-{trace_id:032x}-{span_id:016x}-01"


def broadcast_trace_context(context=None, src: int = 0, group=None) -> Dict[str, str]:
    """Share ``src``'s trace context with every rank of ``group`` in one small broadcast.

    Collective: every rank of ``group`` must call it, whatever its export decision, so gate the call
    only on conditions equal on all ranks (e.g. pipeline size > 1). If ``src`` has no valid span (it
    does not export under the default strategy) it sends a fresh random context instead, so the
    other stages still share one trace. ``src`` is a global rank. The carrier (W3C ``traceparent``
    /``tracestate``) is stored for ``create_linked_span`` and returned.
    Raises ``ValueError`` when ``torch.distributed`` is not initialised.
    """
    import torch
    import torch.distributed as dist

    # Imported here: telemetry stays importable without torch.
    from megatron.core.collective_device import get_collective_device

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("broadcast_trace_context: torch.distributed is not initialised")
    device = get_collective_device(group)
    buf = torch.zeros(CARRIER_BYTES, dtype=torch.uint8, device=device)
    if dist.get_rank() == src:
        carrier = inject_context({}, context)
        if "traceparent" not in carrier:
            carrier = {"traceparent": _fresh_traceparent()}
        payload = json.dumps(carrier, separators=(",", ":")).encode()
        if len(payload) > CARRIER_BYTES:  # an oversized tracestate is dropped, the parent is kept
            payload = json.dumps({"traceparent": carrier["traceparent"]}, separators=(",", ":")).encode()
        buf[: len(payload)] = torch.tensor(list(payload), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=group)
    carrier = json.loads(bytes(buf.cpu().tolist()).rstrip(b"\0").decode())
    _state.set_pipeline_carrier(carrier)
    return carrier


def create_linked_span(name: str, carrier: Optional[Mapping[str, str]] = None, tracer=None,
                       group: str = "communication", **attrs):
    """Context manager for a span of ``group`` (e.g. ``megatron.pp.recv_forward.linked``) that carries
    an OpenTelemetry Link (not a parent) to the context in ``carrier`` (default: the carrier stored by
    ``broadcast_trace_context``). No-op, creating nothing, when the group is off."""
    if group not in _state.ENABLED_GROUPS:
        return _NULL_SPAN_CM
    if carrier is None:
        carrier = _state.get_pipeline_carrier()
    links = None
    ctx = extract_context(carrier)
    if ctx is not None:
        from opentelemetry import trace

        links = [trace.Link(trace.get_current_span(ctx).get_span_context())]
    return _LiveSpanCM(name, tracer, None, attrs, links=links)
