"""Shared test helpers for the telemetry tests: environment isolation and handle clean-up."""
import os

import pytest

from megatron.core.telemetry import state
from megatron.core.telemetry.resources.gpu import reset_nvml_probe

_PREFIXES = ("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_", "SLURM_", "K8S_", "KUBERNETES_", "TORCHELASTIC_",
             "LENS_SLURM_", "NVRX_")
_NAMES = ("LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "DEPLOYMENT_ENV", "ENVIRONMENT", "MASTER_ADDR", "MASTER_PORT",
          "WORLD_SIZE", "RANK")


@pytest.fixture(autouse=True)
def clean_telemetry(monkeypatch):
    """Remove telemetry-relevant variables for the test and shut down any handle it left live."""
    for name in list(os.environ):
        if name.startswith(_PREFIXES) or name in _NAMES:
            monkeypatch.delenv(name, raising=False)
    reset_nvml_probe()
    yield
    reset_nvml_probe()
    handle = state.live_handle()
    if handle is not None:
        handle.shutdown(timeout_ms=2000)
    state.deactivate()


def setup_in_memory(config=None, rank=0, world_size=1, **kwargs):
    """``setup_telemetry`` with in-memory span and metric sinks; returns (handle, spans, reader)."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from megatron.core.telemetry import TelemetryConfig, setup_telemetry

    config = config or TelemetryConfig(enabled=True, span_groups="all")
    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    handle = setup_telemetry(config, rank, world_size, kwargs.pop("resource_attributes", {}),
                             span_exporter=spans, metric_reader=reader, **kwargs)
    return handle, spans, reader


def finished(handle, spans):
    """Flush the batch processor and return the finished spans by name."""
    assert handle.force_flush(5000)
    return {s.name: s for s in spans.get_finished_spans()}


class ManualClock:
    """Step-timing marks (``step_timing.StepTimeRecorder(marks=...)``) read from ``now``, which a test advances
    by hand (seconds), so a section's charged time is exact."""

    deferred, now = False, 0.0

    @classmethod
    def mark(cls):
        return cls.now

    @staticmethod
    def elapsed(start, end):
        return end - start

    @staticmethod
    def resolve():
        pass
