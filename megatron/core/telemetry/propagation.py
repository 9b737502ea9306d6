"""W3C trace-context propagation: put the current context into a dict carrier and read it back."""
from __future__ import annotations

from typing import Dict, Mapping, Optional

__all__ = ["inject_context", "extract_context"]


def inject_context(carrier: Optional[Dict[str, str]] = None, context=None) -> Dict[str, str]:
    """Write ``context`` (default: the current one) into ``carrier`` as W3C ``traceparent``/
    ``tracestate`` entries and return it. Without OpenTelemetry, or when there is no valid span, the
    carrier is returned unchanged."""
    carrier = {} if carrier is None else carrier
    try:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        return carrier
    TraceContextTextMapPropagator().inject(carrier, context=context)
    return carrier


def extract_context(carrier: Optional[Mapping[str, str]]):
    """The OpenTelemetry Context described by ``carrier`` (a remote parent), or ``None`` when the
    carrier is empty, malformed, or OpenTelemetry is missing."""
    if not carrier or "traceparent" not in carrier:
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        return None
    ctx = TraceContextTextMapPropagator().extract(dict(carrier))
    if not trace.get_current_span(ctx).get_span_context().is_valid:
        return None
    return ctx
