"""The console exporter's span line: the SDK's ``ReadableSpan.to_json`` fields, compact, the resource encoded once."""
import io
import json

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, Status, StatusCode

from megatron.core.telemetry.console_format import SpanLineFormatter


def _sdk_line(span) -> str:
    """What the exporter printed before: the SDK's JSON, re-encoded as one compact line."""
    return json.dumps(json.loads(span.to_json(indent=None)), separators=(",", ":"), default=str) + "\n"


def _spans(resource):
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("root", attributes={"i": 1, "f": 1.5, "s": "é\n\"q\"", "t": (1, 2),
                                                          "b": True, "strs": ["a", "b"]}) as root:
        root.add_event("checkpoint", {"megatron.iteration": 3})
        root.set_status(Status(StatusCode.ERROR, "ValueError: bad"))
        with tracer.start_as_current_span("child", links=[Link(root.get_span_context(), {"megatron.link": "job"})]):
            pass
    return exporter.get_finished_spans()


def test_line_equals_the_sdk_json_for_every_field():
    formatter = SpanLineFormatter()
    spans = _spans(Resource.create({"service.name": "megatron-lm", "dl.rank": 0, "list": [1, 2]}))
    assert len(spans) == 2
    for span in spans:
        line = formatter(span)
        assert line == _sdk_line(span)
        assert line.count("\n") == 1 and line.endswith("\n")
    child = json.loads(formatter(spans[0]))
    assert child["parent_id"] is not None and child["links"][0]["attributes"] == {"megatron.link": "job"}
    root = json.loads(formatter(spans[1]))
    assert root["status"] == {"status_code": "ERROR", "description": "ValueError: bad"}
    assert root["events"][0]["name"] == "checkpoint" and root["attributes"]["t"] == [1, 2]


def test_a_new_resource_is_encoded_again():
    formatter = SpanLineFormatter()
    first = _spans(Resource.create({"dl.rank": 0}))[0]
    second = _spans(Resource.create({"dl.rank": 1}))[0]
    assert json.loads(formatter(first))["resource"]["attributes"]["dl.rank"] == 0
    assert json.loads(formatter(second))["resource"]["attributes"]["dl.rank"] == 1
    assert formatter(first) == _sdk_line(first)


def test_console_exporter_writes_one_line_per_span():
    out = io.StringIO()
    exporter = ConsoleSpanExporter(out=out, formatter=SpanLineFormatter())
    spans = _spans(Resource.create({"dl.rank": 0}))
    exporter.export(spans)
    lines = out.getvalue().splitlines()
    assert [json.loads(line)["name"] for line in lines] == ["child", "root"]


def test_metrics_line_equals_the_sdk_json_for_sums_gauges_and_histograms():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from megatron.core.telemetry.console_format import MetricsLineFormatter

    reader = InMemoryMetricReader()
    provider = MeterProvider(resource=Resource.create({"dl.rank": 3}), metric_readers=[reader])
    meter = provider.get_meter("megatron", "1.0")
    meter.create_counter("megatron.training.skipped_iterations", unit="1").add(2, {"dl.rank": 3})
    meter.create_gauge("megatron.training.loss", description="lm loss").set(2.5)
    histogram = meter.create_histogram("megatron.training.step_duration_ms", unit="ms")
    for value in (12.0, 80.5, 7000.0):
        histogram.record(value, {"megatron.split": "train"})
    meter.create_up_down_counter("queue").add(-1)
    data = reader.get_metrics_data()
    formatter = MetricsLineFormatter()
    line = formatter(data)
    assert line == json.dumps(json.loads(data.to_json(indent=None)), separators=(",", ":"), default=str) + "\n"
    names = [m["name"] for rm in json.loads(line)["resource_metrics"] for sm in rm["scope_metrics"]
             for m in sm["metrics"]]
    assert sorted(names) == ["megatron.training.loss", "megatron.training.skipped_iterations",
                             "megatron.training.step_duration_ms", "queue"]
    assert formatter(data) == line  # the cached resource and scope give the same text
    provider.shutdown()
