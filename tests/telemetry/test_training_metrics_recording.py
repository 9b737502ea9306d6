"""record_training_metrics with duck-typed and broken meters, zero skip increments, counters present from the start."""
import logging

import pytest

from megatron.core import telemetry as tel
from megatron.core.telemetry import training_metrics
from telemetry_testutil import clean_telemetry, setup_in_memory  # noqa: F401


_UNSET = object()


class _StrictInstrument:
    """An instrument typed as the OpenTelemetry API documents it: ``attributes`` is optional and, when
    given, a mapping (never None or another type)."""

    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def _take(self, value, attributes):
        if attributes is _UNSET:
            attributes = {}
        elif not isinstance(attributes, dict):
            raise TypeError(f"{self.name}: attributes must be a dict, got {attributes!r}")
        self.calls.append((self.name, value, dict(attributes)))

    def set(self, value, attributes=_UNSET):
        self._take(value, attributes)

    def add(self, value, attributes=_UNSET):
        self._take(value, attributes)

    def record(self, value, attributes=_UNSET):
        self._take(value, attributes)


class _BareInstrument:
    """An instrument of a meter that takes values only: ``record(v)``, ``set(v)``, ``add(v)`` (nemo-lens-style
    shims and test doubles); any keyword is a TypeError."""

    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def set(self, value):
        self.calls.append((self.name, value))

    add = record = set


class _BareMeter:
    def __init__(self):
        self.calls = []

    def create_gauge(self, name, unit="", description=""):
        return _BareInstrument(self.calls, name)

    create_counter = create_histogram = create_gauge


class _DuckMeter:
    def __init__(self):
        self.calls = []

    def create_gauge(self, name, unit="", description=""):
        return _StrictInstrument(self.calls, name)

    create_counter = create_gauge

    def create_histogram(self, name, unit="", description=""):
        return _StrictInstrument(self.calls, name)


class _BrokenInstrument:
    def set(self, value, attributes=None):
        raise RuntimeError("exporter state corrupted")

    add = record = set


class _BrokenMeter:
    def create_gauge(self, name, unit="", description=""):
        return _BrokenInstrument()

    create_counter = create_histogram = create_gauge


def test_duck_typed_meter_gets_real_attribute_dicts():
    meter = _DuckMeter()
    assert tel.record_training_metrics(meter, loss=2.0, step_duration_ms=10.0, skipped_iters=1) == 3
    assert sorted(meter.calls) == [("megatron.training.loss", 2.0, {}),
                                   ("megatron.training.skipped_iters", 1, {}),
                                   ("megatron.training.step_duration_ms", 10.0, {})]
    tel.record_training_metrics(meter, attributes={"dl.rank": 3}, grad_norm=0.5)
    assert meter.calls[-1] == ("megatron.training.grad_norm", 0.5, {"dl.rank": 3})


def test_meter_taking_values_only_gets_every_value_without_attributes(caplog):
    meter = _BareMeter()
    with caplog.at_level(logging.WARNING):
        assert tel.record_training_metrics(meter, loss=2.0, step_duration_ms=10.0, skipped_iters=2,
                                           iteration=7, attributes={}) == 4
        training_metrics.initialize_counters(meter)
    # initialize_counters: every counter at 0 (the skipped iterations, the hang reports, the slow steps).
    assert sorted(meter.calls) == [("megatron.training.hang_reports", 0), ("megatron.training.iteration", 7.0),
                                   ("megatron.training.loss", 2.0),
                                   ("megatron.training.skipped_iters", 0), ("megatron.training.skipped_iters", 2),
                                   ("megatron.training.slow_steps", 0), ("megatron.training.step_duration_ms", 10.0)]
    assert not caplog.records  # nothing dropped, nothing to warn about
    # Attributes, when there are some, are still passed (such a meter then refuses them: logged once).
    with caplog.at_level(logging.WARNING):
        assert tel.record_training_metrics(meter, attributes={"dl.rank": 1}, grad_norm=0.5) == 0
    assert len(caplog.records) == 1


def test_broken_meter_never_reaches_the_training_loop_and_is_logged_once(caplog):
    meter = _BrokenMeter()
    with caplog.at_level(logging.WARNING, logger=training_metrics.logger.name):
        for _ in range(3):
            assert tel.record_training_metrics(meter, loss=1.0, grad_norm=2.0) == 0
    warnings = [r for r in caplog.records if "exporter state corrupted" in r.getMessage()]
    assert len(warnings) == 2, [r.getMessage() for r in warnings]  # once per metric, not once per call
    assert {("loss" in r.getMessage()) for r in warnings} == {True, False}


def test_meter_whose_create_call_fails_is_contained():
    class NoGauges(_DuckMeter):
        def create_gauge(self, *a, **k):
            raise NotImplementedError("gauges not supported")

    meter = NoGauges()
    assert tel.record_training_metrics(meter, loss=1.0, step_duration_ms=5.0) == 1
    assert meter.calls == [("megatron.training.step_duration_ms", 5.0, {})]


def test_zero_skips_record_nothing():
    meter = _DuckMeter()
    tel.record_training_metrics(meter, skipped_iters=0)
    tel.record_training_metrics(meter, skipped_iters=0.0)
    assert meter.calls == []
    tel.record_training_metrics(meter, skipped_iters=2)
    assert meter.calls == [("megatron.training.skipped_iters", 2, {})]


def test_caller_bugs_still_raise():
    with pytest.raises(TypeError, match="unknown metric"):
        tel.record_training_metrics(_DuckMeter(), losss=1.0)
    with pytest.raises(TypeError, match="not a number"):
        tel.record_training_metrics(_DuckMeter(), loss="high")
    with pytest.raises(ValueError, match="finite count"):
        tel.record_training_metrics(_DuckMeter(), skipped_iters=-1)


def _exported(reader):
    data = reader.get_metrics_data()
    if data is None:  # nothing recorded at all
        return {}
    return {m.name: list(m.data.data_points) for rm in data.resource_metrics
            for sm in rm.scope_metrics for m in sm.metrics}


def test_counters_exist_from_the_first_export_and_zero_intervals_add_no_points():
    handle, _, reader = setup_in_memory()
    training_metrics.initialize_counters(handle.meter)
    tel.record_training_metrics(handle.meter, loss=3.0, skipped_iters=0)
    first = _exported(reader)
    assert [p.value for p in first["megatron.training.skipped_iters"]] == [0]
    tel.record_training_metrics(handle.meter, skipped_iters=0)
    tel.record_training_metrics(handle.meter, skipped_iters=2)
    assert [p.value for p in _exported(reader)["megatron.training.skipped_iters"]] == [2]


def test_heartbeat_gauge_reads_the_last_step_time_at_collection():
    handle, _, reader = setup_in_memory()
    now = {"t": None}
    training_metrics.observe_heartbeat(handle.meter, lambda: now["t"])
    assert "megatron.training.last_step_timestamp" not in _exported(reader)  # no step yet: no point
    now["t"] = 1_700_000_000.5
    assert [p.value for p in _exported(reader)["megatron.training.last_step_timestamp"]] == [1_700_000_000.5]
    now["t"] = 1_700_000_060.0  # read at collection time, without any record call
    assert [p.value for p in _exported(reader)["megatron.training.last_step_timestamp"]] == [1_700_000_060.0]


def test_progress_and_breakdown_instruments_have_their_names_and_units():
    handle, _, reader = setup_in_memory()
    tel.record_training_metrics(handle.meter, iteration=7, consumed_samples=56, consumed_tokens=1792,
                                step_forward_compute_ms=12.5, straggler_ratio=1.25,
                                rank_memory_rss_gb=0.4, attributes={"dl.rank": 1})
    data = reader.get_metrics_data()
    metrics = {m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert metrics["megatron.training.iteration"].data.data_points[0].value == 7
    assert metrics["megatron.training.consumed_tokens"].unit == "tokens"
    point = metrics["megatron.training.step.forward_compute_ms"].data.data_points[0]
    assert point.value == 12.5 and dict(point.attributes) == {"dl.rank": 1}
    assert metrics["megatron.training.step.forward_compute_ms"].unit == "ms"
    assert metrics["megatron.training.straggler.ratio"].data.data_points[0].value == 1.25
    assert metrics["megatron.training.memory.rss_gb"].unit == "GB"
