"""End to end: real OTLP receivers (gRPC and HTTP, 127.0.0.1 only) get spans, metrics, resource, headers."""
import gzip
import logging
import socket
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from megatron.core import telemetry as tel
from telemetry_testutil import clean_telemetry  # noqa: F401

TOKEN = "Bearer s3cret-token"


class Received:
    """What a receiver got: decoded requests and the authorization header of each."""

    def __init__(self):
        self.traces, self.metrics, self.auth = [], [], []
        self.lock = threading.Lock()

    def add(self, kind, request, auth):
        with self.lock:
            getattr(self, kind).append(request)
            self.auth.append(auth)


class _TraceServicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received):
        self.received = received

    def Export(self, request, context):
        auth = dict(context.invocation_metadata()).get("authorization")
        self.received.add("traces", request, auth)
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsServicer(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, received):
        self.received = received

    def Export(self, request, context):
        auth = dict(context.invocation_metadata()).get("authorization")
        self.received.add("metrics", request, auth)
        return metrics_service_pb2.ExportMetricsServiceResponse()


def _grpc_receiver():
    received = Received()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceServicer(received), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsServicer(received), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return received, port, lambda: server.stop(grace=None)


def _http_receiver():
    received = Received()
    routes = {"/v1/traces": ("traces", trace_service_pb2.ExportTraceServiceRequest,
                             trace_service_pb2.ExportTraceServiceResponse),
              "/v1/metrics": ("metrics", metrics_service_pb2.ExportMetricsServiceRequest,
                              metrics_service_pb2.ExportMetricsServiceResponse)}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            route = routes.get(self.path)
            if route is None:
                self.send_response(404)
                self.end_headers()
                return
            kind, req_cls, resp_cls = route
            received.add(kind, req_cls.FromString(body), self.headers.get("Authorization"))
            payload = resp_cls().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()

    def stop():
        server.shutdown()
        server.server_close()

    return received, server.server_address[1], stop


def _value(any_value):
    return getattr(any_value, any_value.WhichOneof("value"))


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_spans_and_metrics_reach_a_real_receiver(protocol, monkeypatch):
    received, port, stop = (_grpc_receiver if protocol == "grpc" else _http_receiver)()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20s3cret-token")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "5")
        monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "60000")  # exported once, at shutdown
        cfg = tel.TelemetryConfig(enabled=True, span_groups="per_step", run_id="itest", service_name="itest-svc")
        handle = tel.setup_telemetry(cfg, rank=0, world_size=1, resource_attributes={"dl.local_rank": 0})
        with tel.managed_span("job", "megatron.pretrain", **{"megatron.train_iters": 2}):
            for it in (1, 2):
                with tel.managed_span("step", "megatron.train_step", **{"megatron.iteration": it}):
                    pass
                tel.record_training_metrics(handle.meter, loss=4.0 - it, step_duration_ms=10.0 * it)
        handle.shutdown(timeout_ms=5000)
    finally:
        stop()

    spans = [(rs.resource, s) for req in received.traces for rs in req.resource_spans
             for ss in rs.scope_spans for s in ss.spans]
    by_name = {}
    for resource, span in spans:
        by_name.setdefault(span.name, []).append(span)
    assert sorted(by_name) == ["megatron.pretrain", "megatron.train_step"] and len(by_name["megatron.train_step"]) == 2
    root = by_name["megatron.pretrain"][0]
    assert all(s.parent_span_id == root.span_id and s.trace_id == root.trace_id for s in by_name["megatron.train_step"])
    assert sorted(_value(a.value) for s in by_name["megatron.train_step"] for a in s.attributes
                  if a.key == "megatron.iteration") == [1, 2]
    resource = {a.key: _value(a.value) for a in spans[0][0].attributes}
    assert resource["service.name"] == "itest-svc" and resource["service.instance.id"] == "itest-rank0"
    assert resource["nemo.run.id"] == "itest" and resource["dl.local_rank"] == 0

    metrics = {m.name: m for req in received.metrics for rm in req.resource_metrics
               for sm in rm.scope_metrics for m in sm.metrics}
    assert metrics["megatron.training.loss"].gauge.data_points[-1].as_double == 2.0
    hist = metrics["megatron.training.step_duration_ms"].histogram.data_points[0]
    assert hist.count == 2 and hist.sum == pytest.approx(30.0)
    assert received.auth and all(a == TOKEN for a in received.auth)


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_shutdown_bounded_against_closed_port(protocol, monkeypatch, caplog):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    handle = tel.setup_telemetry(tel.TelemetryConfig(enabled=True, span_groups="all"), 0, 1)
    for i in range(20):
        with tel.managed_span("step", "megatron.train_step", **{"megatron.iteration": i}):
            pass
    tel.record_training_metrics(handle.meter, loss=1.0)
    for _ in range(3):
        handle.force_flush(300)  # repeated failing exports
    open_span = tel.managed_span("job", "megatron.pretrain")
    open_span.__enter__()
    start = time.monotonic()
    handle.shutdown(timeout_ms=2000)
    elapsed = time.monotonic() - start
    assert elapsed < 3.0, f"shutdown took {elapsed:.2f}s"
    handle.shutdown(timeout_ms=2000)  # idempotent and immediate
    assert time.monotonic() - start < 3.0
    # export failures are logged at most once per minute per logger
    noisy = [r.name for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("opentelemetry")]
    assert len(noisy) == len(set(noisy)), noisy
