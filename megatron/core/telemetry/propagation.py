"""W3C trace-context propagation: put the current context into a dict carrier and read it back."""
from __future__ import annotations

from typing import Dict, Mapping, Optional

__all__ = ["inject_context", "extract_context", "has_remote_span"]


def inject_context(carrier: Optional[Dict[str, str]] = None, context=None) -> Dict[str, str]:
    """Write ``context`` (default: the current one) into ``carrier`` with the global propagator
    (W3C ``traceparent``/``tracestate`` and ``baggage`` unless ``OTEL_PROPAGATORS`` says otherwise)
    and return it (nemo-lens returns ``None``; the carrier is filled in place either way). Without
    OpenTelemetry, or when there is no valid span, the carrier is returned unchanged."""
    carrier = {} if carrier is None else carrier
    try:
        from opentelemetry import propagate
    except ImportError:
        return carrier
    propagate.inject(carrier, context=context)
    return carrier


def extract_context(carrier: Optional[Mapping[str, str]]):
    """The OpenTelemetry Context described by ``carrier`` (its span is a remote parent).

    An empty, missing or malformed carrier gives an empty Context, so a span started with
    ``context=extract_context(...)`` is a new root, never a child of whatever span is current.
    Returns ``None`` only when OpenTelemetry is not installed.
    """
    try:
        from opentelemetry import propagate
        from opentelemetry.context import Context
    except ImportError:
        return None
    if not carrier:
        return Context()
    return propagate.extract(dict(carrier), context=Context())


def has_remote_span(context) -> bool:
    """Whether ``context`` (from ``extract_context``) carries a valid span context."""
    if context is None:
        return False
    from opentelemetry import trace

    return trace.get_current_span(context).get_span_context().is_valid
