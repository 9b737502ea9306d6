"""Span helpers for instrumented code: gated ``managed_span``, ``span_cm``, ``trace_fn``, ``trace_region``, attribute filtering."""
from __future__ import annotations

import contextlib
import functools
import re
from typing import Any, Callable, Dict, FrozenSet, Iterable, Mapping, Optional

from . import state as _state
from .global_providers import context_and_trace_api, default_tracer

__all__ = ["managed_span", "span_cm", "trace_fn", "trace_region", "safe_set_span_attributes", "sanitize_attributes",
           "redact_value", "is_span_group_enabled", "REDACTED", "DEFAULT_REDACT_KEYS", "TRACE_REGION_GROUP"]

REDACTED = "[REDACTED]"
_SECRET_WORDS = frozenset({
    "password", "passwd", "pwd", "secret", "token", "apikey", "auth", "authorization", "credential",
    "credentials", "cookie", "privatekey", "accesskey", "secretkey", "sessionkey", "bearer", "signature",
})
_SECRET_SUFFIXES = ("token", "secret", "password", "passwd", "apikey")
_SPLIT = re.compile(r"[^a-z0-9]+")
_SCALARS = (bool, int, float, str)


@functools.lru_cache(maxsize=4096)  # attribute keys are few and repeat on every span
def _is_secret_key(key: str) -> bool:
    parts = [p for p in _SPLIT.split(key.lower()) if p]
    for i, part in enumerate(parts):
        if part in _SECRET_WORDS or part.endswith(_SECRET_SUFFIXES):
            return True
        if i + 1 < len(parts) and parts[i] + parts[i + 1] in _SECRET_WORDS:
            return True  # "api_key", "private.key", "access-key"
    return False


def _scalar(value: Any):
    if isinstance(value, _SCALARS):
        return value
    # 0-d torch tensors and numpy scalars, detected by duck typing so torch is never imported here.
    ndim = getattr(value, "ndim", None)
    if ndim == 0 and callable(getattr(value, "item", None)):
        item = value.item()
        if isinstance(item, _SCALARS):
            return item
    return None


# Content keys (reference nemo-lens's defaults): prompts and generated text are user data, not
# telemetry. A key is redacted when it, or its last dotted component, is one of them.
DEFAULT_REDACT_KEYS: FrozenSet[str] = frozenset({"prompt", "text", "input_text", "output_text", "key"})


def _is_redacted(key: str, redact_keys: FrozenSet[str]) -> bool:
    return key in redact_keys or key.rsplit(".", 1)[-1] in redact_keys or _is_secret_key(key)


def redact_value(key: str, value: Any, redact_keys: Optional[Iterable[str]] = None) -> Any:
    """nemo-lens's ``helpers.redact_value``: ``"[REDACTED]"`` when ``key`` is to be redacted, else ``value``.

    ``key`` is redacted when it is in ``redact_keys`` (default ``DEFAULT_REDACT_KEYS``), when its last
    dotted part is (``gen_ai.prompt`` for ``prompt``), and, whatever ``redact_keys`` holds, when it
    looks like a secret (``*token``, ``password``, ``api_key``, ``authorization``, ...): the same rule
    as ``sanitize_attributes``, wider than nemo-lens's exact-key match (docs/observability.md).
    ``value`` is returned unchanged otherwise, whatever its type.
    """
    redact = DEFAULT_REDACT_KEYS if redact_keys is None else frozenset(redact_keys)
    return REDACTED if isinstance(key, str) and _is_redacted(key, redact) else value


def sanitize_attributes(attributes: Optional[Mapping[str, Any]],
                        redact_keys: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """Keep bool/int/float/str values and homogeneous lists/tuples of them; convert 0-d tensors and
    numpy scalars with ``.item()``; drop everything else (``None``, dicts, n-d tensors, mixed lists,
    non-string keys); replace with ``"[REDACTED]"`` the value of a key that is, or ends in
    ``.<k>`` for, a ``k`` of ``redact_keys`` (default ``DEFAULT_REDACT_KEYS``: prompt, text,
    input_text, output_text, key) and, always, of a secret-looking key (``*token``, ``password``,
    ``api_key``, ``authorization``, ...)."""
    out: Dict[str, Any] = {}
    if not attributes:
        return out
    redact = DEFAULT_REDACT_KEYS if redact_keys is None else frozenset(redact_keys)
    for key, value in attributes.items():
        if not isinstance(key, str) or not key:
            continue
        if isinstance(value, (list, tuple)):
            items = [_scalar(v) for v in value]
            if any(v is None for v in items) or len({type(v) for v in items}) > 1:
                continue
            clean: Any = items
        else:
            clean = _scalar(value)
            if clean is None:
                continue
        out[key] = REDACTED if _is_redacted(key, redact) else clean
    return out


def safe_set_span_attributes(span, attributes: Optional[Mapping[str, Any]] = None,
                             redact_keys: Optional[Iterable[str]] = None, **kwargs: Any) -> None:
    """Set the sanitized ``attributes`` (plus ``kwargs``) on ``span`` if it is recording (see
    ``sanitize_attributes``; ``redact_keys`` replaces the default content keys, secret-looking keys
    are redacted whatever it holds). ``span`` may be ``None`` (a disabled ``managed_span``).
    Returns ``None`` (as nemo-lens does); never raises for odd values."""
    if span is None:
        return None
    merged = dict(attributes) if attributes else {}
    merged.update(kwargs)
    clean = sanitize_attributes(merged, redact_keys)
    if clean and span.is_recording():
        span.set_attributes(clean)
    return None


def is_span_group_enabled(group: str) -> bool:
    """Whether spans of ``group`` are emitted here: one frozenset lookup, no lock."""
    return group in _state.ENABLED_GROUPS


# The disabled path's shared context manager: enter returns None, nothing is allocated per call. It is
# the standard library's nullcontext (stateless, so one instance serves every caller and thread)
# because torch.compile's Dynamo traces through a pre-built nullcontext (and no other pre-built
# context manager: an own no-op class, even a nullcontext subclass, is an "unsupported context
# manager" that breaks the compiled graph at every span of a compiled transformer layer).
_NULL_SPAN_CM = contextlib.nullcontext()


class _LiveSpanCM:
    """Starts ``name`` as the current span on enter; on exit records an exception (unless
    ``record_exception`` is false), sets an error status, re-raises, and ends the span.

    The same steps as the SDK's ``start_as_current_span`` + ``use_span``, without their two
    generator-based context managers, which cost about as much as the span itself on a hot path.
    """

    __slots__ = ("_name", "_tracer", "_context", "_attrs", "_links", "_record", "_span", "_token", "_cm")

    def __init__(self, name: str, tracer, context, attrs: Mapping[str, Any], links=None,
                 record_exception: bool = True):
        self._name, self._tracer, self._context, self._attrs, self._links = name, tracer, context, attrs, links
        self._record = record_exception
        self._span = self._token = self._cm = None

    def __enter__(self):
        tracer = self._tracer or _state.TRACER or default_tracer()
        api = context_and_trace_api()
        attributes = sanitize_attributes(self._attrs) or None
        if not api:  # no OpenTelemetry: the fallback tracer's no-op span
            self._cm = tracer.start_as_current_span(self._name, context=self._context, attributes=attributes,
                                                    links=self._links, record_exception=self._record)
            return self._cm.__enter__()
        context_api, trace_api = api
        span = tracer.start_span(self._name, context=self._context, attributes=attributes, links=self._links,
                                 record_exception=self._record, set_status_on_exception=True)
        self._span = span
        self._token = context_api.attach(trace_api.set_span_in_context(span))
        return span

    def __exit__(self, exc_type, exc, tb):
        if self._cm is not None:
            return self._cm.__exit__(exc_type, exc, tb)
        span = self._span
        context_api, trace_api = context_and_trace_api()
        try:
            context_api.detach(self._token)
            if isinstance(exc, Exception) and span.is_recording():
                if self._record:
                    span.record_exception(exc)
                span.set_status(trace_api.Status(trace_api.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        finally:
            span.end()
        return False


def managed_span(group: str, name: str, tracer=None, context=None, **attrs: Any):
    """Context manager for a span of ``group``: ``with managed_span("step", "megatron.train_step",
    **{"megatron.iteration": 3}) as span:``.

    When ``group`` is off (telemetry disabled, rank not exporting, or group not selected) it returns
    a shared ``contextlib.nullcontext()`` (no span is created; ``span`` is ``None``; the body always
    runs), which ``torch.compile`` traces without a graph break. An enabled span inside a compiled
    region does break the graph (spans are Python side effects). Otherwise
    the span is current inside the block, ``context`` (an OpenTelemetry Context) optionally sets its
    parent, and an exception escaping the block is recorded on the span and re-raised. The tracer is
    ``tracer``, else the live handle's, else the OpenTelemetry global provider's.
    """
    if group not in _state.ENABLED_GROUPS:
        return _NULL_SPAN_CM
    return _LiveSpanCM(name, tracer, context, attrs)


def span_cm(name: str, tracer=None, record_exception: bool = True, *, context=None, **attrs: Any):
    """Context manager that always starts a span (for cold paths) on ``tracer``, else the live
    handle's tracer, else the OpenTelemetry global provider's (so an application that configured
    OpenTelemetry itself gets the span); on ranks that do not export it is the shared no-op span.
    ``record_exception=False`` leaves an escaping exception off the span (the status still says
    error); neither keyword becomes an attribute."""
    return _LiveSpanCM(name, tracer, context, attrs, record_exception=record_exception)


def trace_fn(group: str, name: Optional[str] = None, tracer=None) -> Callable[[Callable], Callable]:
    """Decorator: run the function inside ``managed_span(group, name, tracer)``; the default name is
    ``module.qualname``. The group is checked on every call, so enabling it later takes effect."""

    def decorate(fn: Callable) -> Callable:
        span_name = name or f"{fn.__module__}.{fn.__qualname__}"

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if group not in _state.ENABLED_GROUPS:
                return fn(*args, **kwargs)
            with _LiveSpanCM(span_name, tracer, None, {}):
                return fn(*args, **kwargs)

        return wrapper

    return decorate


TRACE_REGION_GROUP = "trace_region"


class _TraceRegion:
    """What ``trace_region`` returns: a context manager and a decorator. The group is looked up on
    each entry (and each call of a decorated function), so a region defined at import time, before
    telemetry is set up, emits spans once its group is on."""

    __slots__ = ("_name", "_group", "_attrs", "_live")

    def __init__(self, name: str, group: str, attrs: Mapping[str, Any]):
        self._name, self._group, self._attrs = name, group, attrs
        self._live = None  # the entered live spans, innermost last (a region object may be re-entered)

    def __enter__(self):
        if self._group not in _state.ENABLED_GROUPS:
            return None
        cm = _LiveSpanCM(self._name, None, None, self._attrs)
        span = cm.__enter__()
        if self._live is None:
            self._live = []
        self._live.append(cm)
        return span

    def __exit__(self, exc_type, exc, tb):
        if not self._live:
            return False  # entered while the group was off
        return self._live.pop().__exit__(exc_type, exc, tb)

    def __call__(self, fn: Callable) -> Callable:
        name, group, attrs = self._name, self._group, self._attrs

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if group not in _state.ENABLED_GROUPS:
                return fn(*args, **kwargs)
            with _LiveSpanCM(name, None, None, attrs):
                return fn(*args, **kwargs)

        return wrapper


def trace_region(name: str, group: str = TRACE_REGION_GROUP, **attrs: Any) -> _TraceRegion:
    """A span around your own code, in the ``trace_region`` group (or ``group``): use it as
    ``with trace_region("myapp.tokenize", batch=3) as span:`` (``span`` is ``None`` when the group is
    off) or as a decorator, ``@trace_region("myapp.eval_hook")``.

    Off (telemetry disabled, rank not exporting, or the group not selected, as by default: turn it on
    with ``MEGATRON_OTEL_SPAN_GROUPS=default,trace_region``) it costs one small object and one
    frozenset lookup, and no span is created. On, the span is a child of the current span (e.g.
    ``megatron.train_step``), carries ``attrs`` (filtered as ``safe_set_span_attributes`` does), and
    records an exception escaping the block before re-raising it. Inside a ``torch.compile``d region
    use ``managed_span``, whose off path is a ``nullcontext`` the compiler traces through.
    """
    return _TraceRegion(name, group, attrs)
