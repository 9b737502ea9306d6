"""No-op stand-ins with the public helpers' signatures, for when OpenTelemetry is absent or off."""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Mapping, Optional

__all__ = [
    "NoOpSpan", "NoOpTracer", "NoOpMeter", "NoOpInstrument", "NOOP_SPAN", "NOOP_TRACER", "NOOP_METER",
    "managed_span", "span_cm", "trace_fn", "safe_set_span_attributes", "is_span_group_enabled",
    "record_training_metrics", "inject_context", "extract_context", "broadcast_trace_context",
    "create_linked_span", "iteration_trace_context", "iteration_step_span", "setup_logging_bridge",
]


class NoOpSpan:
    """A span that records nothing; one shared instance (``NOOP_SPAN``) so no-op paths allocate none."""

    __slots__ = ()

    def is_recording(self) -> bool:
        return False

    def set_attribute(self, key: str, value: Any) -> None:
        return None

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        return None

    def add_event(self, name: str, attributes: Optional[Mapping[str, Any]] = None, timestamp=None) -> None:
        return None

    def add_link(self, context, attributes=None) -> None:
        return None

    def record_exception(self, exception: BaseException, attributes=None, timestamp=None, escaped=False) -> None:
        return None

    def set_status(self, status, description: Optional[str] = None) -> None:
        return None

    def update_name(self, name: str) -> None:
        return None

    def get_span_context(self):
        return None

    def end(self, end_time=None) -> None:
        return None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return False


NOOP_SPAN = NoOpSpan()


class NoOpTracer:
    """Tracer whose spans are all ``NOOP_SPAN``; same call shapes as ``opentelemetry.trace.Tracer``."""

    __slots__ = ()

    def start_span(self, name: str, context=None, kind=None, attributes=None, links=None, start_time=None,
                   record_exception: bool = True, set_status_on_exception: bool = True) -> NoOpSpan:
        return NOOP_SPAN

    def start_as_current_span(self, name: str, context=None, kind=None, attributes=None, links=None,
                              start_time=None, record_exception: bool = True,
                              set_status_on_exception: bool = True, end_on_exit: bool = True) -> NoOpSpan:
        return NOOP_SPAN


NOOP_TRACER = NoOpTracer()


class NoOpInstrument:
    """Counter/histogram/gauge that drops every measurement."""

    __slots__ = ()

    def add(self, amount, attributes=None, context=None) -> None:
        return None

    def record(self, amount, attributes=None, context=None) -> None:
        return None

    def set(self, amount, attributes=None, context=None) -> None:
        return None


_NOOP_INSTRUMENT = NoOpInstrument()


class NoOpMeter:
    """Meter whose instruments drop everything; same call shapes as ``opentelemetry.metrics.Meter``."""

    __slots__ = ("__weakref__",)

    def _make(self, name: str, unit: str = "", description: str = "", **kwargs) -> NoOpInstrument:
        return _NOOP_INSTRUMENT

    create_counter = create_up_down_counter = create_histogram = create_gauge = _make
    create_observable_counter = create_observable_up_down_counter = create_observable_gauge = _make


NOOP_METER = NoOpMeter()


class _NullCM:
    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, exc_type, exc, tb):
        return False


_NULL_CM = _NullCM()


def managed_span(group: str, name: str, tracer=None, context=None, **attrs) -> _NullCM:
    """No-op ``managed_span``: the body runs, the ``as`` target is ``None``."""
    return _NULL_CM


def span_cm(name: str, tracer=None, record_exception: bool = True, *, context=None, **attrs) -> _NullCM:
    """No-op ``span_cm``: the body runs, the ``as`` target is ``None``."""
    return _NULL_CM


def trace_fn(group: str, name: Optional[str] = None, tracer=None) -> Callable[[Callable], Callable]:
    """No-op ``trace_fn``: returns the function unchanged."""
    def decorate(fn: Callable) -> Callable:
        return fn
    return decorate


def safe_set_span_attributes(span, attributes: Optional[Mapping[str, Any]] = None, redact_keys=None,
                             **kwargs) -> None:
    """No-op: sets nothing and returns ``None``."""
    return None


def is_span_group_enabled(group: str) -> bool:
    """Always ``False``."""
    return False


def record_training_metrics(meter, *, attributes=None, **values) -> int:
    """No-op: records nothing and returns 0."""
    return 0


def inject_context(carrier: Optional[Dict[str, str]] = None, context=None) -> Dict[str, str]:
    """No-op: returns ``carrier`` (or a new empty dict) unchanged."""
    return {} if carrier is None else carrier


def extract_context(carrier: Optional[Mapping[str, str]]):
    """No-op: ``None``."""
    return None


def broadcast_trace_context(*args, **kwargs) -> Optional[Dict[str, str]]:
    """No-op without communicating: ``None`` for nemo-lens's ``(rank, src_rank=0)`` shape, else ``{}``."""
    if "rank" in kwargs or "src_rank" in kwargs or (args and isinstance(args[0], int)):
        return None
    return {}


def create_linked_span(*args, **kwargs):
    """No-op ``create_linked_span``: ``NOOP_SPAN`` for nemo-lens's ``(tracer, name, ...)`` shape (a
    span the caller ends), else a context manager yielding ``None``."""
    if args and not isinstance(args[0], str):
        return NOOP_SPAN
    return _NULL_CM


def iteration_step_span(group: str, iteration: int, handle=None, **attrs) -> _NullCM:
    """No-op ``iteration_step_span``: the body runs, the ``as`` target is ``None``."""
    return _NULL_CM


def iteration_trace_context(run_id: str, iteration: int, sampled: Optional[bool] = None,
                            launch_uuid: Optional[str] = None):
    """No-op: ``None`` (start spans without a shared parent)."""
    return None


def setup_logging_bridge(target=None, level: Optional[int] = None, logger: Optional[logging.Logger] = None, *,
                         logger_name: Optional[str] = None):
    """No-op: attaches nothing and returns ``None``."""
    return None

