"""Metric reader that exports a snapshot at every training log interval without blocking training."""
from __future__ import annotations

import collections
import logging
import os
import threading
import time

from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, attach, set_value
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, PeriodicExportingMetricReader

__all__ = ["LogIntervalMetricReader", "export_interval_ms"]

logger = logging.getLogger(__name__)
DEFAULT_EXPORT_INTERVAL_MS = 60_000.0
MAX_QUEUED_SNAPSHOTS = 256


def export_interval_ms(environ=None) -> float:
    """``OTEL_METRIC_EXPORT_INTERVAL`` in ms (the SDK's 60000 when unset or not a positive number:
    the SDK's reader would refuse a non-positive one at start-up)."""
    env = os.environ if environ is None else environ
    try:
        value = float(env.get("OTEL_METRIC_EXPORT_INTERVAL", DEFAULT_EXPORT_INTERVAL_MS))
    except ValueError:
        return DEFAULT_EXPORT_INTERVAL_MS
    return value if value > 0 else DEFAULT_EXPORT_INTERVAL_MS


class _BackgroundExporter(MetricExporter):
    """Exporter front whose ``export`` only queues the batch: a thread hands the batches, in order, to
    the real exporter. At most ``MAX_QUEUED_SNAPSHOTS`` wait; beyond that the oldest is dropped (the
    batch-queue rule of spec section 8). Batches queued in a forked child are dropped (the parent owns
    the exporter; the SDK reader restarts its timer in the child)."""

    def __init__(self, exporter: MetricExporter) -> None:
        super().__init__(preferred_temporality=exporter._preferred_temporality,
                         preferred_aggregation=exporter._preferred_aggregation)
        self._exporter = exporter
        self._queue = collections.deque(maxlen=MAX_QUEUED_SNAPSHOTS)
        self._cond = threading.Condition()
        self._busy = self._stopped = False
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="megatron-otel-metrics", daemon=True)
        self._thread.start()

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        if os.getpid() == self._pid:
            with self._cond:
                if not self._stopped:
                    self._queue.append(metrics_data)
                    self._cond.notify_all()
        return MetricExportResult.SUCCESS

    def _run(self) -> None:
        attach(set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))  # this thread only exports (as the SDK's readers mark it)
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = self._queue.popleft()
                self._busy = True
            try:
                self._exporter.export(batch, timeout_millis=10_000)
            except Exception:
                logger.debug("telemetry metric export failed", exc_info=True)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        """Wait, at most ``timeout_millis``, until every queued batch went to the exporter."""
        deadline = time.monotonic() + max(0.0, timeout_millis) / 1000.0
        with self._cond:
            while self._queue or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(remaining)
        return True

    def shutdown(self, timeout_millis: float = 30_000, timeout: float = None, **kwargs) -> None:
        # The SDK reader passes the remaining time as ``timeout`` (ms).
        budget = max(0.0, timeout_millis if timeout is None else timeout)
        deadline = time.monotonic() + budget / 1000.0
        self.force_flush(budget * 0.8)
        with self._cond:
            self._stopped = True
            self._queue.clear()
            self._cond.notify_all()
        try:
            self._exporter.shutdown(timeout_millis=max(0.0, deadline - time.monotonic()) * 1000.0)
        except Exception:
            logger.debug("telemetry metric exporter shutdown failed", exc_info=True)


class LogIntervalMetricReader(PeriodicExportingMetricReader):
    """The SDK's periodic reader (every ``interval_ms``, default ``OTEL_METRIC_EXPORT_INTERVAL``) that
    also collects on demand (``snapshot()``, called by the training loop after each ``--log-interval``
    record), with the export moved to a background thread.

    Why: gauges keep only their last value, so a reader that collects every 60 s loses every value
    logged in between; and the SDK reader exports on the collecting thread, which would make training
    wait on a slow or dead collector. Collecting is an in-memory snapshot (cheap); the export happens on
    the thread (``_BackgroundExporter``). ``force_flush`` collects and waits, bounded by its timeout,
    for the queue to drain, and says whether it did.
    """

    def __init__(self, exporter: MetricExporter, interval_ms: float = None) -> None:
        super().__init__(_BackgroundExporter(exporter),
                         export_interval_millis=export_interval_ms() if interval_ms is None else interval_ms)

    def snapshot(self) -> None:
        """Queue the current values for export; never waits on the exporter or raises."""
        try:
            self.collect()
        except Exception:  # a failed collection must not stop training
            logger.debug("telemetry metric collection failed", exc_info=True)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        self.snapshot()
        return self._exporter.force_flush(timeout_millis)
