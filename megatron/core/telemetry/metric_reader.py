"""Metric reader that exports a snapshot at every training log interval without blocking training."""
from __future__ import annotations

import collections
import logging
import os
import threading
import time

from opentelemetry.sdk.metrics.export import MetricReader

__all__ = ["LogIntervalMetricReader", "export_interval_ms"]

logger = logging.getLogger(__name__)
DEFAULT_EXPORT_INTERVAL_MS = 60_000.0
MAX_QUEUED_SNAPSHOTS = 256


def export_interval_ms(environ=None) -> float:
    """``OTEL_METRIC_EXPORT_INTERVAL`` in ms (the SDK's 60000 when unset or not a positive number)."""
    env = os.environ if environ is None else environ
    try:
        value = float(env.get("OTEL_METRIC_EXPORT_INTERVAL", DEFAULT_EXPORT_INTERVAL_MS))
    except ValueError:
        return DEFAULT_EXPORT_INTERVAL_MS
    return value if value > 0 else DEFAULT_EXPORT_INTERVAL_MS


class LogIntervalMetricReader(MetricReader):
    """Collects on demand (``snapshot()``, called by the training loop after each ``--log-interval``
    record) and every ``interval_ms`` (``OTEL_METRIC_EXPORT_INTERVAL``); exports on a background thread.

    Why: gauges keep only their last value, so a reader that collects every 60 s loses every value
    logged in between. Collecting is an in-memory snapshot (cheap); the export, which can wait on a
    slow or dead collector, happens on the thread, so training never waits on it. At most
    ``MAX_QUEUED_SNAPSHOTS`` snapshots wait; beyond that the oldest is dropped (the batch-queue rule of
    spec section 8). ``force_flush`` collects and waits, bounded by its timeout, for the queue to drain.
    """

    def __init__(self, exporter, interval_ms: float = DEFAULT_EXPORT_INTERVAL_MS) -> None:
        super().__init__(preferred_temporality=exporter._preferred_temporality,
                         preferred_aggregation=exporter._preferred_aggregation)
        self._exporter = exporter
        self._interval_s = max(float(interval_ms), 1.0) / 1000.0
        self._queue = collections.deque(maxlen=MAX_QUEUED_SNAPSHOTS)
        self._cond = threading.Condition()
        self._busy = False
        self._stopped = False
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="megatron-otel-metrics", daemon=True)
        self._thread.start()

    def _receive_metrics(self, metrics_data, timeout_millis: float = 10_000, **kwargs) -> None:
        if metrics_data is None:
            return
        with self._cond:
            self._queue.append(metrics_data)
            self._cond.notify_all()

    def snapshot(self) -> None:
        """Queue the current values for export; never waits on the exporter. No-op after shutdown or
        in a forked child (the parent owns the exporter)."""
        if self._stopped or os.getpid() != self._pid:
            return
        try:
            self.collect()
        except Exception:  # a failed collection must not stop training
            logger.debug("telemetry metric collection failed", exc_info=True)

    def _run(self) -> None:
        next_periodic = time.monotonic() + self._interval_s
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    remaining = next_periodic - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                if self._stopped and not self._queue:
                    return
                batch = self._queue.popleft() if self._queue else None
                self._busy = batch is not None
            if batch is None:  # the periodic collection: it queues a snapshot for the next turn
                next_periodic = time.monotonic() + self._interval_s
                self.snapshot()
                continue
            try:
                self._exporter.export(batch, timeout_millis=10_000)
            except Exception:
                logger.debug("telemetry metric export failed", exc_info=True)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _wait_drained(self, timeout_millis: float) -> bool:
        deadline = time.monotonic() + max(0.0, timeout_millis) / 1000.0
        with self._cond:
            while self._queue or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(remaining)
        return True

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        self.snapshot()
        return self._wait_drained(timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        deadline = time.monotonic() + max(0.0, timeout_millis) / 1000.0
        self.snapshot()
        self._wait_drained(timeout_millis * 0.8)
        with self._cond:
            self._stopped = True
            self._queue.clear()
            self._cond.notify_all()
        try:
            self._exporter.shutdown(timeout_millis=max(0.0, deadline - time.monotonic()) * 1000.0)
        except Exception:
            logger.debug("telemetry metric exporter shutdown failed", exc_info=True)
