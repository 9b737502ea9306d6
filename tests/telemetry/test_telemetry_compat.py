"""Code written for Megatron-LM's telemetry and nemo-lens runs unchanged here (issue 13, "Why"):
global tracer provider, reference call shapes, redaction, empty carriers, shutdown order, the log
bridge and exporter errors, GPU count, config and strategy checks."""
import json
import logging
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from megatron.core import telemetry as tel
from megatron.core.telemetry import fallbacks
from megatron.training import argument_utils
from telemetry_testutil import clean_telemetry, finished, setup_in_memory  # noqa: F401

REPO = Path(__file__).resolve().parents[2]


def _other_tracer():
    """A tracer of a separate SDK provider with its own in-memory exporter (a user's own tracer)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("user"), exporter


# ------------------------------------------------------------------------------ global provider
def test_user_tracers_reach_the_exporters_across_setups():
    from opentelemetry import trace

    early = trace.get_tracer("user.lib")  # taken at import time, before setup_telemetry
    handle, spans, _ = setup_in_memory()
    with trace.get_tracer("third.party").start_as_current_span("lib.span"):
        with early.start_as_current_span("early.span"):
            pass
    got = finished(handle, spans)
    assert {"lib.span", "early.span"} <= set(got)
    assert got["early.span"].parent.span_id == got["lib.span"].context.span_id
    handle.shutdown(timeout_ms=2000)
    with early.start_as_current_span("after.shutdown") as span:
        assert not span.is_recording()  # no live provider: the global tracer is a no-op
    again, spans2, _ = setup_in_memory()
    with early.start_as_current_span("second.setup"):
        pass
    assert "second.setup" in finished(again, spans2)  # the same tracer object reaches the new exporters


APP_SCRIPT = textwrap.dedent(r'''
    import json
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # the application configured OpenTelemetry itself

    from megatron.core import telemetry as tel

    tel.set_enabled_groups({"step"})

    @tel.trace_fn("step", "app.trace_fn")
    def work():
        return 3

    with tel.span_cm("app.span_cm"):
        assert work() == 3
    with tel.managed_span("step", "app.managed") as span:
        assert span.is_recording()
    print(json.dumps(sorted(s.name for s in exporter.get_finished_spans())))
''')


def test_application_provider_gets_helper_spans():
    proc = subprocess.run([sys.executable, "-c", APP_SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ["app.managed", "app.span_cm", "app.trace_fn"]


def _metric_values(reader):
    """{metric name: value (sum/gauge) or count (histogram)} of one collection of ``reader``."""
    values = {}
    data = reader.get_metrics_data()
    for rm in (data.resource_metrics if data else []):
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                point = metric.data.data_points[0]
                values[metric.name] = getattr(point, "value", None) if hasattr(point, "value") else point.count
    return values


def test_user_meters_and_loggers_reach_the_exporters_across_setups():
    from opentelemetry import metrics
    from opentelemetry.metrics import Observation

    meter = metrics.get_meter("user.lib")  # taken at import time, before setup_telemetry
    requests = meter.create_counter("user.requests")
    meter.create_observable_gauge("user.temperature", callbacks=[lambda options: [Observation(42.0)]])
    try:
        _user_meters_and_loggers(requests)
    finally:  # an observable instrument lives as long as the (process-wide) global provider: not past this test
        provider = metrics.get_meter_provider()
        getattr(provider, "_observables", []).clear()


def _user_meters_and_loggers(requests):
    from opentelemetry import _logs, metrics
    from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter

    user_logger = _logs.get_logger("user.lib")
    cfg = tel.TelemetryConfig(enabled=True, logs_enabled=True, span_groups="all")
    logs = InMemoryLogRecordExporter()
    handle, _, reader = setup_in_memory(cfg, log_exporter=logs)
    requests.add(3)
    metrics.get_meter("third.party").create_histogram("user.latency").record(1.5)
    user_logger.emit(_logs.LogRecord(body="from user code"))
    values = _metric_values(reader)
    assert values["user.requests"] == 3 and values["user.latency"] == 1 and values["user.temperature"] == 42.0
    assert "from user code" in _bodies(handle, logs)
    handle.shutdown(timeout_ms=2000)
    requests.add(100)  # no live provider: dropped, no error
    user_logger.emit(_logs.LogRecord(body="after shutdown"))
    logs2 = InMemoryLogRecordExporter()
    again, _, reader2 = setup_in_memory(cfg, log_exporter=logs2)
    requests.add(5)  # the same instrument object reaches the new exporters
    user_logger.emit(_logs.LogRecord(body="second setup"))
    values = _metric_values(reader2)
    assert values["user.requests"] == 5 and values["user.temperature"] == 42.0
    assert _bodies(again, logs2) == ["second setup"]


APP_PROVIDERS_SCRIPT = textwrap.dedent(r'''
    import json
    from opentelemetry import _logs, metrics
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter

    app_reader = InMemoryMetricReader()
    app_meters, app_loggers = MeterProvider(metric_readers=[app_reader]), LoggerProvider()
    metrics.set_meter_provider(app_meters)  # the application configured OpenTelemetry itself
    _logs.set_logger_provider(app_loggers)

    from megatron.core import telemetry as tel

    ours = InMemoryMetricReader()
    handle = tel.setup_telemetry(tel.TelemetryConfig(enabled=True, logs_enabled=True), 0, 1,
                                 span_exporter=InMemorySpanExporter(), metric_reader=ours,
                                 log_exporter=InMemoryLogRecordExporter())
    assert metrics.get_meter_provider() is app_meters and _logs.get_logger_provider() is app_loggers
    metrics.get_meter("app").create_counter("app.count").add(2)
    tel.record_training_metrics(handle.meter, loss=1.5)

    def names(reader):
        data = reader.get_metrics_data()
        return sorted(m.name for rm in (data.resource_metrics if data else []) for sm in rm.scope_metrics
                      for m in sm.metrics)

    print(json.dumps([names(app_reader), [n for n in names(ours) if not n.startswith("megatron.")]]))
    handle.shutdown(timeout_ms=2000)
''')


def test_application_meter_and_logger_providers_are_kept():
    proc = subprocess.run([sys.executable, "-c", APP_PROVIDERS_SCRIPT], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [["app.count"], []]


# ----------------------------------------------------------------------------- reference shapes
def test_trace_fn_accepts_tracer_in_helpers_and_fallbacks():
    tracer, exporter = _other_tracer()
    handle, spans, _ = setup_in_memory()

    @tel.trace_fn("step", "on.user.tracer", tracer=tracer)
    def f(x):
        return x + 1

    assert f(1) == 2
    assert [s.name for s in exporter.get_finished_spans()] == ["on.user.tracer"]
    assert "on.user.tracer" not in finished(handle, spans)
    assert fallbacks.trace_fn("step", "n", tracer=tracer)(f) is f
    assert fallbacks.trace_fn("step", "n", None)(f) is f


def test_redact_keys_and_return_value():
    handle, spans, _ = setup_in_memory()
    with tel.managed_span("step", "s") as span:
        assert tel.safe_set_span_attributes(span, {"user": "bob", "prompt": "hi", "n": 1},
                                            redact_keys=frozenset({"user"})) is None
    with tel.managed_span("step", "d") as span:
        tel.safe_set_span_attributes(span, {"prompt": "p", "text": "t", "input_text": "i", "output_text": "o",
                                            "key": "k", "gen_ai.prompt": "g", "megatron.iteration": 4,
                                            "hf_token": "secret"})
    assert fallbacks.safe_set_span_attributes(None, {"a": 1}, redact_keys={"a"}) is None
    got = finished(handle, spans)
    assert dict(got["s"].attributes) == {"user": "[REDACTED]", "prompt": "hi", "n": 1}
    assert dict(got["d"].attributes) == {
        "prompt": "[REDACTED]", "text": "[REDACTED]", "input_text": "[REDACTED]", "output_text": "[REDACTED]",
        "key": "[REDACTED]", "gen_ai.prompt": "[REDACTED]", "megatron.iteration": 4, "hf_token": "[REDACTED]",
    }


def test_span_cm_record_exception_false():
    from opentelemetry.trace import StatusCode

    handle, spans, _ = setup_in_memory()
    with pytest.raises(ValueError):
        with tel.span_cm("quiet", record_exception=False, **{"megatron.iteration": 2}):
            raise ValueError("boom")
    with pytest.raises(ValueError):
        with tel.span_cm("loud"):
            raise ValueError("boom")
    got = finished(handle, spans)
    assert got["quiet"].events == () or list(got["quiet"].events) == []
    assert dict(got["quiet"].attributes) == {"megatron.iteration": 2}
    assert got["quiet"].status.status_code == StatusCode.ERROR
    assert [e.name for e in got["loud"].events] == ["exception"]
    with pytest.raises(ValueError):
        with tel.span_cm("positional", None, False):  # nemo-lens's (name, tracer, record_exception)
            raise ValueError("boom")
    assert list(finished(handle, spans)["positional"].events) == []
    with fallbacks.span_cm("x", None, False) as span:
        assert span is None


def test_create_linked_span_reference_shape():
    handle, spans, _ = setup_in_memory()
    with tel.span_cm("remote") as remote:
        carrier = tel.inject_context({})
    linked = tel.create_linked_span(handle.tracer, "ref.linked", remote_carrier=carrier, **{"dl.microbatch_id": 3})
    linked.end()  # a started span the caller ends
    with tel.create_linked_span(handle.tracer, "ref.ctx", tel.extract_context(carrier)):
        pass
    unlinked = tel.create_linked_span(handle.tracer, "ref.none", remote_carrier={"traceparent": "bad"})
    unlinked.end()
    with tel.create_linked_span("ours.linked", carrier):  # ours: a context manager, group-gated
        pass
    got = finished(handle, spans)
    remote_ctx = remote.get_span_context()
    for name in ("ref.linked", "ref.ctx", "ours.linked"):
        assert [link.context.span_id for link in got[name].links] == [remote_ctx.span_id], name
    assert got["ref.linked"].attributes["dl.microbatch_id"] == 3
    assert list(got["ref.none"].links) == []
    assert fallbacks.create_linked_span(handle.tracer, "n").end() is None


def test_broadcast_trace_context_reference_shape_without_distributed():
    assert tel.broadcast_trace_context(0) is None
    assert tel.broadcast_trace_context(rank=1, src_rank=0) is None
    assert fallbacks.broadcast_trace_context(0, 0) is None
    with pytest.raises(ValueError, match="not initialised"):
        tel.broadcast_trace_context()  # ours keeps its documented error


@pytest.mark.parametrize("carrier", [{}, None, {"traceparent": "garbage"}, {"other": "x"}])
def test_extract_of_empty_carrier_makes_a_new_root(carrier):
    handle, spans, _ = setup_in_memory()
    with tel.span_cm("current"):
        with tel.span_cm("fresh", context=tel.extract_context(carrier)):
            pass
    got = finished(handle, spans)
    assert got["fresh"].parent is None
    assert got["fresh"].context.trace_id != got["current"].context.trace_id


# ------------------------------------------------------------------------------------ shutdown
def test_shutdown_ends_children_first_with_truncation_event_and_drops_late_spans():
    handle, spans, _ = setup_in_memory()
    outer = tel.managed_span("job", "outer")
    outer.__enter__()
    inner = tel.managed_span("step", "inner")
    inner.__enter__()
    tracer = handle.tracer
    handle.shutdown(timeout_ms=2000)
    order = [s.name for s in spans.get_finished_spans()]
    assert order == ["inner", "outer"]
    got = {s.name: s for s in spans.get_finished_spans()}
    assert got["inner"].end_time <= got["outer"].end_time
    for span in got.values():
        assert span.attributes["nemo.span.truncated"] is True
        assert [e.name for e in span.events] == ["nemo.span.truncated"]
    late = tracer.start_span("late")  # a tracer kept past shutdown
    assert handle._providers.span_tracker._open == {}  # not tracked: it would never be released
    late.end()
    assert "late" not in [s.name for s in spans.get_finished_spans()]
    logging.getLogger("opentelemetry.sdk.trace").disabled = True  # the late __exit__s warn "already ended"
    try:
        inner.__exit__(None, None, None)
        outer.__exit__(None, None, None)
    finally:
        logging.getLogger("opentelemetry.sdk.trace").disabled = False


# ------------------------------------------------------------------------------- logging bridge
def _logs_setup():
    from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter

    logs = InMemoryLogRecordExporter()
    cfg = tel.TelemetryConfig(enabled=True, logs_enabled=True, span_groups="all")
    handle, spans, _ = setup_in_memory(cfg, log_exporter=logs)
    return handle, logs


def _bodies(handle, logs):
    assert handle.force_flush(5000)
    return [r.log_record.body for r in logs.get_finished_logs()]


def test_logging_bridge_reference_call_shapes(capsys):
    handle, logs = _logs_setup()
    root_handler = tel.setup_logging_bridge()  # as Megatron's start-up calls it
    try:
        assert root_handler in logging.getLogger().handlers and root_handler.level == logging.INFO
        app_handler = tel.setup_logging_bridge("my.app")
        assert app_handler in logging.getLogger("my.app").handlers
        logging.getLogger("my.app").propagate = False
        logging.getLogger("my.app").warning("from the app")
        logging.getLogger("other").warning("from the root bridge")
        assert {"from the app", "from the root bridge"} <= set(_bodies(handle, logs))
        assert "Logging error" not in capsys.readouterr().err
    finally:
        logging.getLogger("my.app").propagate = True
        handle.shutdown(timeout_ms=2000)
    assert root_handler not in logging.getLogger().handlers  # torn down with its handle
    assert fallbacks.setup_logging_bridge() is None and fallbacks.setup_logging_bridge("my.app") is None


def test_exporter_errors_reach_the_console_and_are_never_exported(monkeypatch, capsys):
    handle, logs = _logs_setup()
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # nothing but the bridge on the root logger
    tel.setup_logging_bridge(handle)
    logging.getLogger("opentelemetry.exporter.otlp.test_bridge").warning("Failed to export span batch")
    logging.getLogger("megatron.core.telemetry.test_bridge").warning("telemetry shutdown ran late")
    logging.getLogger("megatron.training.test_bridge").warning("a training message")
    err = capsys.readouterr().err
    assert "Failed to export span batch" in err and "telemetry shutdown ran late" in err
    bodies = _bodies(handle, logs)
    assert "a training message" in bodies
    assert "Failed to export span batch" not in bodies and "telemetry shutdown ran late" not in bodies


# ------------------------------------------------------------------------------ GPU count, NVML
def _counting_pynvml(count=8):
    calls = []
    mod = types.ModuleType("pynvml")
    mod.nvmlInit = lambda: calls.append("init")
    mod.nvmlShutdown = lambda: calls.append("shutdown")
    mod.nvmlDeviceGetCount = lambda: count
    mod.nvmlDeviceGetHandleByIndex = lambda i: i
    mod.nvmlDeviceGetName = lambda h: b"NVIDIA H100"
    mod.nvmlDeviceGetUUID = lambda h: f"GPU-{h}"
    mod.nvmlDeviceGetSerial = lambda h: "SN"
    mod.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=b"0000:1B:00.0")
    return mod, calls


def test_host_gpu_count_honours_cuda_visible_devices(monkeypatch):
    from megatron.core.telemetry.resources import detect_local_attributes

    mod, _ = _counting_pynvml(count=8)
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    assert detect_local_attributes({"CUDA_VISIBLE_DEVICES": "2,3,5"})["host.gpu.count"] == 3
    assert detect_local_attributes({"CUDA_VISIBLE_DEVICES": ""})["host.gpu.count"] == 0
    assert detect_local_attributes({})["host.gpu.count"] == 8


def test_exporting_rank_probes_nvml_once(monkeypatch):
    from argparse import Namespace

    mod, calls = _counting_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    args = Namespace(otel_enabled=True, otel_service_name=None, otel_span_groups=None, local_rank=0,
                     tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=1,
                     global_batch_size=8, seq_length=32)
    monkeypatch.setenv("MEGATRON_OTEL_EXPORTER", "console")
    monkeypatch.setenv("MEGATRON_OTEL_METRICS_ENABLED", "0")
    handle = argument_utils.setup_telemetry_from_args(args, rank=0, world_size=1, local_rank=0)
    assert handle.is_exporting
    assert calls.count("init") == 1, calls
    assert handle.resource_attributes["host.gpu.count"] == 8 and handle.resource_attributes["dl.gpu.uuid"] == "GPU-0"


# ----------------------------------------------------------------------- config and strategies
def test_sample_rate_refused_by_constructor_and_from_env():
    with pytest.raises(ValueError, match=r"export_sample_rate must be in \[0.0, 1.0\]"):
        tel.TelemetryConfig(export_sample_rate=1.5)
    with pytest.raises(ValueError, match=r"MEGATRON_OTEL_EXPORT_SAMPLE_RATE: export_sample_rate must be in \[0.0, 1.0\], got -0.5"):
        tel.TelemetryConfig.from_env(environ={"MEGATRON_OTEL_EXPORT_SAMPLE_RATE": "-0.5"})
    assert tel.TelemetryConfig(export_sample_rate=0.0).export_sample_rate == 0.0


def test_builtin_strategy_override_and_unknown_unregister():
    cfg = tel.TelemetryConfig(rank_strategy="single_rank")
    assert tel.should_export(cfg, 3, 4) and not tel.should_export(cfg, 0, 4)
    tel.register_rank_strategy("single_rank", lambda c, r, w: r == 0, allow_override=True)
    try:
        assert tel.should_export(cfg, 0, 4) and not tel.should_export(cfg, 3, 4)
    finally:
        assert tel.unregister_rank_strategy("single_rank") is True  # restores the built-in
    assert tel.should_export(cfg, 3, 4)
    with pytest.raises(ValueError, match="Cannot unregister built-in strategy"):
        tel.unregister_rank_strategy("single_rank")
    with pytest.raises(ValueError, match="'nobody' is not registered"):
        tel.unregister_rank_strategy("nobody")
