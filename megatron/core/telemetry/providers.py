"""The only module that imports the OpenTelemetry SDK: providers, exporters, ids, fork safety, shutdown."""
from __future__ import annotations

import json
import logging
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace import sampling as otel_sampling
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import INVALID_SPAN_ID, INVALID_TRACE_ID

from .otlp_env import check_otlp_headers, otlp_protocol
from .metric_reader import LogIntervalMetricReader, export_interval_ms

__all__ = ["PrivateIdGenerator", "start_span_with_ids", "OpenSpanTracker", "Providers", "build_providers", "shutdown_providers",
           "force_flush_providers", "build_resource", "compact_json_line", "rank_aware_sampler"]

logger = logging.getLogger(__name__)
TRUNCATED_ATTR = "nemo.span.truncated"
TRUNCATED_REASON_ATTR = "nemo.span.truncated.reason"
_ERROR_LOG_INTERVAL_S = 60.0


# ----------------------------------------------------------------------------------------------- ids
# Trace and span ids come from a private generator seeded by the OS: training's random.seed() cannot
# reach it (that would make every data-parallel rank emit the same ids), and a forked child reseeds it
# so that it does not repeat its parent's ids. Not the OS generator itself: a system call per id costs
# more than the rest of starting a span on some virtual machines.
_RANDOM = random.Random(os.urandom(32))


def _reseed_ids() -> None:
    _RANDOM.seed(os.urandom(32))


os.register_at_fork(after_in_child=_reseed_ids)


_FORCED = threading.local()


class PrivateIdGenerator(IdGenerator):
    """Random 128-bit trace ids and 64-bit span ids from the OS's generator, except for
    the one span ``start_span_with_ids`` starts on this thread (the derived iteration root)."""

    def generate_span_id(self) -> int:
        forced = getattr(_FORCED, "span_id", None)
        if forced is not None:
            _FORCED.span_id = None
            return forced
        span_id = _RANDOM.getrandbits(64)
        while span_id == INVALID_SPAN_ID:
            span_id = _RANDOM.getrandbits(64)
        return span_id

    def generate_trace_id(self) -> int:
        forced = getattr(_FORCED, "trace_id", None)
        if forced is not None:
            _FORCED.trace_id = None
            return forced
        trace_id = _RANDOM.getrandbits(128)
        while trace_id == INVALID_TRACE_ID:
            trace_id = _RANDOM.getrandbits(128)
        return trace_id

    def is_trace_id_random(self) -> bool:
        return True


def start_span_with_ids(tracer, name: str, trace_id: int, span_id: int, **options):
    """Start ``name`` as a new root whose trace id and span id are the given ones (not random), on a
    tracer of a provider built here; ``options`` go to ``tracer.start_span`` (``context`` defaults
    to an empty one, i.e. a root). Used for the per-iteration root that every pipeline stage
    derives without communication (``distributed.iteration_span_ids``). Returns the started span."""
    from opentelemetry.context import Context

    options.setdefault("context", Context())
    _FORCED.trace_id, _FORCED.span_id = int(trace_id), int(span_id)
    try:
        return tracer.start_span(name, **options)
    finally:
        _FORCED.trace_id = _FORCED.span_id = None


# -------------------------------------------------------------------------------------- sampling
class RankAwareSampler(otel_sampling.Sampler):
    """All-or-nothing per rank (decided by the caller from the rank hash), composed with the SDK's
    environment sampler: a kept rank still applies ``OTEL_TRACES_SAMPLER`` (e.g. a trace-id ratio)."""

    def __init__(self, keep_rank: bool, rank: int) -> None:
        self._keep = bool(keep_rank)
        self._rank = int(rank)
        self._inner = otel_sampling._get_from_env_or_default()

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None):
        if not self._keep:
            return otel_sampling.SamplingResult(otel_sampling.Decision.DROP)
        return self._inner.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"RankAware{{rank={self._rank},keep={self._keep},inner={self._inner.get_description()}}}"


def rank_aware_sampler(keep_rank: bool, rank: int) -> RankAwareSampler:
    """The ``rank_aware`` Sampler for one rank (see ``sampling.register_sampling_strategy``)."""
    return RankAwareSampler(keep_rank, rank)


# ------------------------------------------------------------------------------- error rate limiting
class _RateLimitFilter(logging.Filter):
    """Let through at most one WARNING-or-worse record per logger per minute, so an unreachable
    collector cannot flood the training log; the next one reports how many were suppressed."""

    def __init__(self, interval_s: float = _ERROR_LOG_INTERVAL_S) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last: Dict[str, float] = {}
        self._suppressed: Dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        now = time.monotonic()
        if record.name.startswith("opentelemetry.exporter"):
            _note_export_failure(now)
        last = self._last.get(record.name)
        if last is not None and now - last < self.interval_s:
            self._suppressed[record.name] = self._suppressed.get(record.name, 0) + 1
            return False
        self._last[record.name] = now
        dropped = self._suppressed.pop(record.name, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} similar telemetry export messages suppressed)"
        return True


_RATE_LIMIT = _RateLimitFilter()
# When an OTLP exporter last reported a failed export (its WARNING records: connection refused, timeout,
# unavailable), monotonic seconds; None if never. Shutdown then waits only briefly for the collector.
_LAST_EXPORT_FAILURE: Optional[float] = None
EXPORT_FAILURE_MEMORY_S = 30.0
# What shutdown still waits for a flush after a recent export failure, before aborting the exporters.
FAILED_COLLECTOR_WAIT_S = 0.25


def _note_export_failure(now: float) -> None:
    global _LAST_EXPORT_FAILURE
    _LAST_EXPORT_FAILURE = now


def recent_export_failure(within_s: float = EXPORT_FAILURE_MEMORY_S) -> bool:
    """Whether an OTLP exporter of this process reported a failed export in the last ``within_s`` seconds."""
    last = _LAST_EXPORT_FAILURE
    return last is not None and time.monotonic() - last < within_s


def _rate_limit_export_logs() -> None:
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("opentelemetry.exporter", "opentelemetry.sdk")):
            lg = logging.getLogger(name)
            if _RATE_LIMIT not in lg.filters:
                lg.addFilter(_RATE_LIMIT)


# ------------------------------------------------------------------------- open spans, fork safety
class OpenSpanTracker(SpanProcessor):
    """Front span processor: remembers spans that started and have not ended, so that shutdown can
    end them (innermost first, marked truncated), and forwards ended spans to ``delegate`` only in
    the process that created it, so a forked child never re-exports its parent's spans (the SDK's
    batch processor restarts itself in a child; this is the one guard it lacks)."""

    def __init__(self, delegate: SpanProcessor) -> None:
        self._delegate = delegate
        self._pid = os.getpid()
        self._closed = False
        # Keyed by (trace_id, span_id), in start order: dict set/pop are atomic under the GIL, so no
        # lock to inherit in a locked state across fork.
        self._open: Dict[Tuple[int, int], object] = {}

    def on_start(self, span, parent_context=None) -> None:
        if os.getpid() != self._pid or self._closed:
            return  # after shutdown nothing would ever end it: tracking it would leak it
        ctx = span.get_span_context()
        self._open[(ctx.trace_id, ctx.span_id)] = span
        self._delegate.on_start(span, parent_context=parent_context)

    def on_end(self, span) -> None:
        if os.getpid() != self._pid:
            return
        ctx = span.get_span_context()
        if self._open.pop((ctx.trace_id, ctx.span_id), None) is None and self._closed:
            return  # started after shutdown: dropped, the exporter is gone
        self._delegate.on_end(span)

    def end_open_spans(self) -> int:
        """Stop tracking new spans and end every span still open, children before their parents
        (reverse start order: a child starts after its parent), each marked
        ``nemo.span.truncated=true`` plus a ``nemo.span.truncated`` event (as nemo-lens does; the
        end time is the shutdown time, not the end of the work). Returns how many were ended.
        In a forked child it does nothing and returns 0: the spans it inherited are the parent's, still
        open there; ending them here would mark the parent's work truncated in the child's copy and,
        were any processor to forward them, export them twice."""
        if os.getpid() != self._pid:
            return 0
        self._closed = True
        spans = list(self._open.values())
        for span in reversed(spans):
            try:
                span.set_attribute(TRUNCATED_ATTR, True)
                span.add_event(TRUNCATED_ATTR, {TRUNCATED_REASON_ATTR: "still open at telemetry shutdown"})
                span.end()
            except Exception:
                logger.debug("could not end open span at shutdown", exc_info=True)
        return len(spans)

    def shutdown(self) -> None:
        if os.getpid() == self._pid:  # a child's copy of the batch processor holds nothing of its own
            self._delegate.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        if os.getpid() != self._pid:
            return True
        return self._delegate.force_flush(timeout_millis)


# ------------------------------------------------------------------------------------- exporters
def compact_json_line(obj_json: str) -> str:
    """Re-encode the SDK's JSON text as one compact line (``{"a":1,...}`` + newline)."""
    return json.dumps(json.loads(obj_json), separators=(",", ":"), default=str) + "\n"


def _otlp_module(signal: str):
    protocol = otlp_protocol(signal)
    if protocol == "grpc":
        if signal == "traces":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as cls
        elif signal == "metrics":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as cls
        else:
            from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter as cls
    else:
        if signal == "traces":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as cls
        elif signal == "metrics":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as cls
        else:
            from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter as cls
    return cls


def _build_exporter(kind: str, signal: str, out):
    """OTLP exporter for ``signal`` over the configured protocol, or a console one-line-JSON exporter.
    Endpoint, headers, timeout and TLS come from the standard ``OTEL_EXPORTER_OTLP_*`` variables.
    Raises ``ValueError`` (naming the variable, not its value) for malformed ``OTEL_EXPORTER_OTLP_*HEADERS``."""
    if kind == "console":
        if signal == "traces":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            from .console_format import SpanLineFormatter

            return ConsoleSpanExporter(out=out, formatter=SpanLineFormatter())
        if signal == "metrics":
            from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

            from .console_format import MetricsLineFormatter

            return ConsoleMetricExporter(out=out, formatter=MetricsLineFormatter())
        from opentelemetry.sdk._logs.export import ConsoleLogRecordExporter

        return ConsoleLogRecordExporter(out=out, formatter=lambda r: compact_json_line(r.to_json(indent=None)))
    check_otlp_headers()  # the SDK would print a malformed value, credentials included
    return _otlp_module(signal)()


def build_resource(attributes: Mapping[str, object]) -> Resource:
    """SDK Resource from ``attributes`` merged over ``OTEL_RESOURCE_ATTRIBUTES`` (ours win)."""
    return Resource.create(dict(attributes))


# ------------------------------------------------------------------------------------- providers
@dataclass
class Providers:
    """The SDK objects one exporting process owns."""

    tracer_provider: Optional[TracerProvider] = None
    meter_provider: Optional[MeterProvider] = None
    logger_provider: Optional[LoggerProvider] = None
    span_tracker: Optional[OpenSpanTracker] = None
    metric_reader: Optional[object] = None
    exporters: List[object] = field(default_factory=list)


def build_providers(
    config,
    resource_attributes: Mapping[str, object],
    span_exporter=None,
    metric_reader=None,
    log_exporter=None,
    sampler=None,
    out=None,
) -> Providers:
    """Create tracer/meter/logger providers for the enabled signals of ``config``.

    ``span_exporter``/``log_exporter`` replace the configured exporter; ``metric_reader`` replaces
    the ``LogIntervalMetricReader`` (a snapshot at each ``snapshot_metrics`` call, i.e. every
    ``--log-interval``, plus one every ``OTEL_METRIC_EXPORT_INTERVAL``). The SDK's processors catch
    exporter errors and restart themselves in a forked child; ``OpenSpanTracker`` keeps a child from
    exporting its parent's spans. Providers do not register their own (unbounded) ``atexit``
    shutdown; ``shutdown_providers`` is bounded.
    Raises ``ValueError`` for a bad ``OTEL_EXPORTER_OTLP_*PROTOCOL`` or malformed ``..._HEADERS``.
    """
    out = sys.stdout if out is None else out
    resource = build_resource(resource_attributes)
    providers = Providers()
    if config.traces_enabled:
        exporter = span_exporter or _build_exporter(config.exporter, "traces", out)
        tracker = OpenSpanTracker(BatchSpanProcessor(exporter))
        tp = TracerProvider(sampler=sampler, resource=resource, shutdown_on_exit=False,
                            id_generator=PrivateIdGenerator())
        tp.add_span_processor(tracker)
        providers.tracer_provider, providers.span_tracker = tp, tracker
        providers.exporters.append(exporter)
    if config.metrics_enabled:
        kind = str(getattr(config, "metrics_exporter", "") or config.exporter).strip().lower()
        if metric_reader is None and kind == "prometheus":
            from .prometheus_reader import build_prometheus_reader

            metric_reader = build_prometheus_reader(config, int(resource_attributes.get("dl.local_rank", 0) or 0))
        if metric_reader is None:
            exporter = _build_exporter(kind, "metrics", out)
            metric_reader = LogIntervalMetricReader(exporter, export_interval_ms())
            providers.exporters.append(exporter)
        providers.metric_reader = metric_reader
        providers.meter_provider = MeterProvider(resource=resource, metric_readers=[metric_reader],
                                                 shutdown_on_exit=False)
    if config.logs_enabled:
        exporter = log_exporter or _build_exporter(config.exporter, "logs", out)
        lp = LoggerProvider(resource=resource, shutdown_on_exit=False)
        lp.add_log_record_processor(BatchLogRecordProcessor(exporter))
        providers.logger_provider = lp
        providers.exporters.append(exporter)
    _rate_limit_export_logs()
    return providers


def force_flush_providers(providers: Providers, timeout_ms: int) -> bool:
    """Export everything buffered, waiting at most ``timeout_ms`` in total; returns success."""
    done = threading.Event()
    result = {"ok": False}

    def work():
        ok = True
        for p in (providers.tracer_provider, providers.meter_provider, providers.logger_provider):
            if p is not None:
                try:
                    ok = bool(p.force_flush(timeout_ms)) and ok
                except Exception:
                    ok = False
        result["ok"] = ok
        done.set()

    threading.Thread(target=work, name="megatron-otel-flush", daemon=True).start()
    return done.wait(timeout_ms / 1000.0) and result["ok"]


def _abort(exporter) -> None:
    """Shut ``exporter`` down now: the OTLP exporters then leave their retry back-off and close their
    channel, so a dead collector cannot hold the shutdown. Never raises."""
    try:
        try:
            exporter.shutdown(timeout_millis=0)
        except TypeError:
            exporter.shutdown()
    except Exception:
        logger.debug("telemetry exporter abort failed", exc_info=True)


def shutdown_providers(providers: Providers, timeout_ms: int) -> bool:
    """End open spans (marked truncated), flush and shut down every provider, and return within
    ``timeout_ms`` even when the collector is unreachable or slow: the work runs on a daemon thread;
    at 80 % of the budget (after ``FAILED_COLLECTOR_WAIT_S`` when an exporter reported a failed
    export in the last ``EXPORT_FAILURE_MEMORY_S``) the exporters are aborted (channels closed,
    retries stopped) and whatever is left is abandoned. Returns whether everything finished in time. Never raises."""
    deadline = time.monotonic() + max(0, timeout_ms) / 1000.0
    if providers.span_tracker is not None:
        providers.span_tracker.end_open_spans()
    done = threading.Event()

    def work():
        for name, p in (("metrics", providers.meter_provider), ("traces", providers.tracer_provider),
                        ("logs", providers.logger_provider)):
            if p is None:
                continue
            remaining_ms = max(0.0, (deadline - time.monotonic()) * 1000.0)
            try:
                if name == "metrics":
                    p.shutdown(timeout_millis=remaining_ms)
                else:
                    p.shutdown()
            except Exception:
                logger.debug("telemetry %s provider shutdown failed", name, exc_info=True)
        done.set()

    threading.Thread(target=work, name="megatron-otel-shutdown", daemon=True).start()
    soft = max(0.0, (deadline - time.monotonic()) * 0.8)
    if recent_export_failure():
        # The collector failed an export moments ago: give the final flush a brief chance, then abort
        # (an unreachable collector would otherwise hold the exit for most of the budget).
        soft = min(soft, FAILED_COLLECTOR_WAIT_S)
    if not done.wait(soft):
        for exporter in providers.exporters:
            _abort(exporter)
        done.wait(max(0.0, deadline - time.monotonic()))
    return done.is_set()

