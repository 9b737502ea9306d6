"""setup_telemetry / TelemetryHandle lifecycle, console JSONL, ids, metrics, logging bridge, resources."""
import io
import json
import logging
import random
import time

import pytest

from megatron.core import telemetry as tel
from megatron.core.telemetry import state
from telemetry_testutil import clean_telemetry, finished, setup_in_memory  # noqa: F401


def test_double_init_guard_shutdown_idempotent_and_reinit():
    handle, spans, _ = setup_in_memory()
    with pytest.raises(RuntimeError, match="already been initialised"):
        setup_in_memory()
    disabled = tel.setup_telemetry(tel.TelemetryConfig(enabled=False), 0, 1)  # a disabled call is allowed
    assert not disabled.is_exporting and state.live_handle() is handle
    handle.shutdown(timeout_ms=1000)
    handle.shutdown(timeout_ms=1000)
    assert handle.is_shutdown and tel.get_enabled_groups() == frozenset()
    again, _, _ = setup_in_memory()
    assert again.is_exporting and tel.get_active_handle() is again


def test_open_spans_truncated_at_shutdown():
    handle, spans, _ = setup_in_memory()
    outer = tel.managed_span("job", "megatron.pretrain")
    outer.__enter__()
    with tel.managed_span("step", "megatron.train_step"):
        pass
    handle.shutdown(timeout_ms=2000)
    got = {s.name: s for s in spans.get_finished_spans()}
    assert got["megatron.pretrain"].attributes["nemo.span.truncated"] is True
    assert "nemo.span.truncated" not in got["megatron.train_step"].attributes
    logging.getLogger("opentelemetry.sdk.trace").disabled = True  # the late __exit__ warns "already ended"
    try:
        outer.__exit__(None, None, None)
    finally:
        logging.getLogger("opentelemetry.sdk.trace").disabled = False


def test_resource_identity(monkeypatch):
    monkeypatch.setenv("NEMO_LENS_USER_ID", "team-a")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "site=lab,dl.rank=99")
    cfg = tel.TelemetryConfig.from_env()
    cfg.enabled, cfg.run_id, cfg.span_groups = True, "run42", "all"
    handle, spans, _ = setup_in_memory(cfg, rank=3, world_size=4, resource_attributes={"dl.local_rank": 3})
    with tel.managed_span("job", "j"):
        pass
    res = dict(finished(handle, spans)["j"].resource.attributes)
    assert res["service.name"] == "megatron-lm" and res["service.instance.id"] == "run42-rank3"
    assert res["nemo.run.id"] == "run42" and res["nemo.user.id"] == "team-a" and res["site"] == "lab"
    assert res["dl.rank"] == 3 and res["dl.world_size"] == 4 and res["dl.local_rank"] == 3
    assert (res["nemo.lens.job_uuid"], res["nemo.lens.run_uuid"]) == tel.compute_job_uuids()
    assert res["service.version"] == __import__("megatron").__version__ and "host.name" in res


def test_ids_ignore_random_seed():
    handle, spans, _ = setup_in_memory()
    ids = []
    for _ in range(2):
        random.seed(1234)
        with tel.managed_span("step", "s") as span:
            ctx = span.get_span_context()
            ids.append((ctx.trace_id, ctx.span_id))
    assert ids[0] != ids[1]


def test_sdk_disabled_makes_rank_non_exporting(monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    handle = tel.setup_telemetry(tel.TelemetryConfig(enabled=True, rank_strategy="all_ranks"), 0, 1)
    assert handle.enabled and not handle.is_exporting


def test_traces_off_metrics_on():
    handle, spans, reader = setup_in_memory(tel.TelemetryConfig(enabled=True, traces_enabled=False, span_groups="all"))
    assert handle.tracer_provider is None and tel.get_enabled_groups() == frozenset()
    assert tel.record_training_metrics(handle.meter, loss=1.0) == 1
    assert reader.get_metrics_data() is not None


def test_console_exporter_writes_jsonl():
    out = io.StringIO()
    cfg = tel.TelemetryConfig(enabled=True, exporter="console", span_groups="all", logs_enabled=True)
    handle = tel.setup_telemetry(cfg, 0, 1, {"dl.local_rank": 0}, out=out)
    tel.setup_logging_bridge(handle, logger=logging.getLogger("megatron.test.console"))
    with tel.managed_span("job", "megatron.pretrain", **{"megatron.model_type": "gpt"}):
        logging.getLogger("megatron.test.console").warning("hello %s", "world")
    tel.record_training_metrics(handle.meter, loss=3.0, step_duration_ms=5.0)
    handle.shutdown(timeout_ms=3000)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    objs = [json.loads(line) for line in lines]  # every line is one complete JSON object
    assert all(json.dumps(o, separators=(",", ":")) == line for o, line in zip(objs, lines))  # compact
    span = next(o for o in objs if o.get("name") == "megatron.pretrain")
    assert span["attributes"]["megatron.model_type"] == "gpt"
    log = next(o for o in objs if o.get("body") == "hello world")
    assert log["trace_id"] == span["context"]["trace_id"] and log["span_id"] == span["context"]["span_id"]
    metric_names = {m["name"] for o in objs for rm in o.get("resource_metrics", [])
                    for sm in rm["scope_metrics"] for m in sm["metrics"]}
    assert {"megatron.training.loss", "megatron.training.step_duration_ms"} <= metric_names


def _points(reader):
    out = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = (m, list(m.data.data_points))
    return out


def test_training_metrics_instruments():
    from opentelemetry.sdk.metrics._internal.point import Gauge, Histogram, Sum

    handle, _, reader = setup_in_memory()
    n = tel.record_training_metrics(handle.meter, step_duration_ms=120.0, loss=2.5, throughput_tflops=100.0,
                                    tokens_per_sec=5000.0, grad_norm=torch_scalar(0.75), skipped_iters=2,
                                    learning_rate=3e-4, memory_allocated_gb=None, attributes={"phase": "train"})
    assert n == 7
    tel.record_training_metrics(handle.meter, step_duration_ms=80.0, skipped_iters=1, validation_loss=2.0,
                                validation_ppl=7.389)
    pts = _points(reader)
    expected = {name: (kind, unit) for name, kind, unit, _ in tel.TRAINING_INSTRUMENTS.values()}
    assert set(pts) == set(expected) - {"megatron.training.memory_allocated_gb"}
    kinds = {"histogram": Histogram, "gauge": Gauge, "counter": Sum}
    for name, (metric, points) in pts.items():
        assert isinstance(metric.data, kinds[expected[name][0]]) and metric.unit == expected[name][1]
    hist = pts["megatron.training.step_duration_ms"][1]
    assert sum(p.count for p in hist) == 2 and sum(p.sum for p in hist) == pytest.approx(200.0)
    assert sum(p.value for p in pts["megatron.training.skipped_iters"][1]) == 3
    assert pts["megatron.training.loss"][1][0].value == 2.5
    assert pts["megatron.training.grad_norm"][1][0].value == 0.75
    assert dict(pts["megatron.training.loss"][1][0].attributes) == {"phase": "train"}
    assert pts["megatron.validation.ppl"][1][0].value == pytest.approx(7.389)
    assert tel.training_metrics.get_instruments(handle.meter) is tel.training_metrics.get_instruments(handle.meter)
    with pytest.raises(TypeError, match="unknown metric"):
        tel.record_training_metrics(handle.meter, losss=1.0)
    with pytest.raises(ValueError, match="finite count"):
        tel.record_training_metrics(handle.meter, skipped_iters=-1)
    assert tel.record_training_metrics(None, loss=1.0) == 0


def torch_scalar(value):
    import torch

    return torch.tensor(value)


def test_logging_bridge_idempotent_with_trace_ids():
    from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter

    logs = InMemoryLogRecordExporter()
    cfg = tel.TelemetryConfig(enabled=True, logs_enabled=True, span_groups="all")
    handle, spans, _ = setup_in_memory(cfg, log_exporter=logs)
    target = logging.getLogger("megatron.test.bridge")
    target.setLevel(logging.INFO)
    first = tel.setup_logging_bridge(handle, logger=target)
    assert tel.setup_logging_bridge(handle, logger=target) is first and target.handlers.count(first) == 1
    with tel.managed_span("step", "megatron.train_step") as span:
        target.info("iteration %d done", 5)
    target.error("outside")
    handle.force_flush(3000)
    records = {r.log_record.body: r.log_record for r in logs.get_finished_logs()}
    inside, outside = records["iteration 5 done"], records["outside"]
    assert inside.trace_id == span.get_span_context().trace_id and inside.span_id == span.get_span_context().span_id
    assert outside.span_id == 0 and outside.severity_text == "ERROR" and inside.severity_text == "INFO"
    handle.shutdown(timeout_ms=2000)
    assert first not in target.handlers  # shutdown detaches the bridge
    assert tel.setup_logging_bridge(tel.setup_telemetry(tel.TelemetryConfig(), 0, 1), logger=target) is None


def test_shutdown_is_bounded_with_a_hanging_exporter():
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Hanging(SpanExporter):
        def export(self, spans):
            time.sleep(30)
            return SpanExportResult.SUCCESS

    handle, _, _ = setup_in_memory()
    handle.shutdown(timeout_ms=10)
    handle = tel.setup_telemetry(tel.TelemetryConfig(enabled=True, metrics_enabled=False), 0, 1,
                                 span_exporter=Hanging())
    with tel.managed_span("job", "j"):
        pass
    start = time.monotonic()
    handle.shutdown(timeout_ms=500)
    assert time.monotonic() - start < 1.5
