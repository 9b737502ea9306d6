"""Issue 9 item 7: every value logged at a --log-interval reaches the metric exporter, and the
skipped-iterations counter is exported from the start, at 0."""

import pytest

from pretrain_utils import console_objects, losses_from_log, run_pretrain
from telemetry_testutil import clean_telemetry  # noqa: F401


def _points(records, name):
    """Every exported data point of metric ``name``, in export order."""
    found = []
    for record in records:
        for rm in record.get("resource_metrics", []):
            for sm in rm["scope_metrics"]:
                for metric in sm["metrics"]:
                    if metric["name"] == name:
                        found.extend(metric["data"]["data_points"])
    return found


def test_every_logged_loss_reaches_the_exporter_and_skips_start_at_zero(shared_data, shakespeare_prefix, tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("MEGATRON_OTEL_ENABLED", "1")
    monkeypatch.setenv("MEGATRON_OTEL_EXPORTER", "console")
    monkeypatch.setenv("MEGATRON_OTEL_TRACES_ENABLED", "0")
    monkeypatch.delenv("OTEL_METRIC_EXPORT_INTERVAL", raising=False)  # the 60 s default: longer than the run
    out = run_pretrain(1, ["--micro-batch-size", "4", "--train-iters", "5", "--eval-interval", "100"],
                       shared_data, shakespeare_prefix, tmp_path)
    logged = losses_from_log(out)
    assert sorted(logged) == [1, 2, 3, 4, 5]
    records = console_objects(out)
    exported = [p["value"] for p in _points(records, "megatron.training.loss")]
    for iteration, loss in logged.items():  # the log line prints 6 significant digits
        assert any(v == pytest.approx(float(loss), rel=1e-5) for v in exported), \
            f"loss {loss} of iteration {iteration} never exported; exported {exported}"
    skipped = _points(records, "megatron.training.skipped_iters")
    assert skipped, "megatron.training.skipped_iters was never exported"
    assert skipped[0]["value"] == 0 and all(p["value"] == 0 for p in skipped)


def test_each_snapshot_is_exported_and_flush_waits_for_it(clean_telemetry):
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

    from megatron.core import telemetry as tel
    from megatron.core.telemetry.metric_reader import LogIntervalMetricReader

    class Capture(MetricExporter):
        def __init__(self):
            super().__init__()
            self.values = []

        def export(self, metrics_data, timeout_millis=10_000, **kwargs):
            for rm in metrics_data.resource_metrics:
                for sm in rm.scope_metrics:
                    self.values += [(m.name, p.value) for m in sm.metrics for p in m.data.data_points]
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis=10_000):
            return True

        def shutdown(self, timeout_millis=30_000, **kwargs):
            pass

    exporter = Capture()
    reader = LogIntervalMetricReader(exporter, interval_ms=3_600_000)  # no periodic export during the test
    handle = tel.setup_telemetry(tel.TelemetryConfig(enabled=True, traces_enabled=False), 0, 1,
                                 metric_reader=reader)
    tel.training_metrics.initialize_counters(handle.meter)  # the training loop does this once (prepare_metrics)
    for loss in (3.0, 2.5, 2.0):
        tel.record_training_metrics(handle.meter, loss=loss, skipped_iters=0)
        reader.snapshot()
    assert reader.force_flush(5000)
    losses = [v for name, v in exporter.values if name == "megatron.training.loss"]
    assert [v for i, v in enumerate(losses) if i == 0 or v != losses[i - 1]] == [3.0, 2.5, 2.0]
    assert ("megatron.training.skipped_iters", 0) in exporter.values
    handle.shutdown(timeout_ms=2000)
