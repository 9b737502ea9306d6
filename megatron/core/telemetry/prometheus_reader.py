"""Pull-mode metrics: a Prometheus scrape endpoint on each exporting rank (``MEGATRON_OTEL_METRICS_EXPORTER=prometheus``).

Uses ``opentelemetry-exporter-prometheus``; the endpoint of a rank is
``http://{MEGATRON_OTEL_PROMETHEUS_HOST}:{MEGATRON_OTEL_PROMETHEUS_PORT + LOCAL_RANK}/metrics`` (default host
127.0.0.1: set ``0.0.0.0`` to be scraped from another machine; port 0 lets the OS choose and logs it).
The resource attributes that tell series apart (service, run id, parallel ranks) become labels, as the
collector's ``resource_to_telemetry_conversion`` makes them, so one Grafana dashboard serves both the
pull endpoint and the collector (``observability/``). ``dl.rank`` is left to the data points: the per-rank
series (step breakdown, memory) carry it as an attribute, also for rows sent on behalf of other ranks.
Stage-level series (``megatron.training.straggler.*``) get only ``STAGE_RESOURCE_ATTRIBUTES`` from the
resource: they name their pipeline stage, not the rank that sends them.
"""
from __future__ import annotations

import logging

__all__ = ["PROMOTED_RESOURCE_ATTRIBUTES", "STAGE_LEVEL_METRIC_PREFIX", "STAGE_RESOURCE_ATTRIBUTES",
           "split_stage_level", "build_prometheus_reader"]

logger = logging.getLogger(__name__)

PROMOTED_RESOURCE_ATTRIBUTES = frozenset({
    "service.name", "service.instance.id", "nemo.run.id", "host.name", "dl.local_rank",
    "dl.tensor_parallel.rank", "dl.pipeline_parallel.rank", "dl.data_parallel.rank", "dl.context_parallel.rank",
})


# Series about a pipeline stage, not a rank: labelled with the stage and the run, never with the
# sending rank's coordinates (the collector's transform/promote_resource matches the same prefix).
STAGE_LEVEL_METRIC_PREFIX = "megatron.training.straggler."
STAGE_RESOURCE_ATTRIBUTES = frozenset({"service.name", "nemo.run.id"})


def split_stage_level(metrics_data):
    """``metrics_data`` with the stage-level metrics of each resource moved under a copy of that
    resource that keeps only ``STAGE_RESOURCE_ATTRIBUTES`` (the SDK's ``MetricsData`` types, rebuilt)."""
    from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics, ScopeMetrics
    from opentelemetry.sdk.resources import Resource

    out = []
    for rm in metrics_data.resource_metrics:
        rank_scopes, stage_scopes = [], []
        for sm in rm.scope_metrics:
            stage = [m for m in sm.metrics if m.name.startswith(STAGE_LEVEL_METRIC_PREFIX)]
            if not stage:
                rank_scopes.append(sm)
                continue
            rest = [m for m in sm.metrics if not m.name.startswith(STAGE_LEVEL_METRIC_PREFIX)]
            if rest:
                rank_scopes.append(ScopeMetrics(scope=sm.scope, metrics=rest, schema_url=sm.schema_url))
            stage_scopes.append(ScopeMetrics(scope=sm.scope, metrics=stage, schema_url=sm.schema_url))
        if rank_scopes:
            out.append(ResourceMetrics(resource=rm.resource, scope_metrics=rank_scopes, schema_url=rm.schema_url))
        if stage_scopes:
            kept = {k: v for k, v in rm.resource.attributes.items() if k in STAGE_RESOURCE_ATTRIBUTES}
            out.append(ResourceMetrics(resource=Resource(kept, rm.resource.schema_url), scope_metrics=stage_scopes,
                                       schema_url=rm.schema_url))
    return MetricsData(resource_metrics=out)


def build_prometheus_reader(config, local_rank: int = 0):
    """A ``PrometheusMetricReader`` on its own registry, served over HTTP until the reader shuts down.

    Raises ``ImportError`` naming the package when ``opentelemetry-exporter-prometheus`` is missing.
    A port that cannot be bound is logged (training goes on; the endpoint is then absent).
    """
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as error:
        raise ImportError("MEGATRON_OTEL_METRICS_EXPORTER=prometheus needs the opentelemetry-exporter-prometheus "
                          "package (pip install opentelemetry-exporter-prometheus)") from error

    class _ServedReader(PrometheusMetricReader):
        """Stops its HTTP server at shutdown (bounded: the server thread is a daemon)."""

        server = None

        def _receive_metrics(self, metrics_data, timeout_millis: float = 10_000, **kwargs) -> None:
            if metrics_data is not None:
                metrics_data = split_stage_level(metrics_data)
            super()._receive_metrics(metrics_data, timeout_millis=timeout_millis, **kwargs)

        def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
            if self.server is not None:
                self.server.shutdown()
                self.server.server_close()
                self.server = None
            super().shutdown(timeout_millis=timeout_millis, **kwargs)

    registry = CollectorRegistry(auto_describe=False)
    reader = _ServedReader(resource_attribute_filter=PROMOTED_RESOURCE_ATTRIBUTES.__contains__, registry=registry)
    port = int(config.prometheus_port)
    port = port + int(local_rank) if port else 0
    try:
        server, _ = start_http_server(port, addr=config.prometheus_host, registry=registry)
    except OSError as error:
        logger.error("telemetry: cannot serve Prometheus metrics on %s:%d (%s); set MEGATRON_OTEL_PROMETHEUS_PORT",
                     config.prometheus_host, port, error)
        return reader
    reader.server = server
    logger.info("telemetry: Prometheus metrics at http://%s:%d/metrics", config.prometheus_host, server.server_port)
    return reader
