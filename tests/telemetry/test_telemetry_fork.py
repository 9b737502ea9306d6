"""Fork safety: a child forked with spans open (and an export in flight) exports nothing and never hangs."""
import os
import threading
import time

import pytest

from megatron.core import telemetry as tel
from megatron.core.telemetry import state
from telemetry_testutil import clean_telemetry  # noqa: F401


class FileExporter:
    """Span exporter that appends "pid name" lines to a file (shared by parent and child), slowly,
    so the fork can happen while an export holds the batch processor's lock."""

    def __init__(self, path, delay_s=0.0):
        self.path, self.delay_s = path, delay_s

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        time.sleep(self.delay_s)
        with open(self.path, "a") as f:
            for span in spans:
                f.write(f"{os.getpid()} {span.name}\n")
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis=30000):
        return True


def _wait(pid, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail(f"forked child did not finish within {timeout_s}s (hang)")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_exports_nothing_and_does_not_hang(tmp_path):
    path = tmp_path / "spans.txt"
    handle = tel.setup_telemetry(tel.TelemetryConfig(enabled=True, span_groups="all", metrics_enabled=False), 0, 1,
                                 span_exporter=FileExporter(path, delay_s=0.3))
    with tel.managed_span("step", "parent.before_fork"):
        pass
    flusher = threading.Thread(target=handle.force_flush, args=(5000,))  # export in flight during the fork
    with tel.managed_span("job", "parent.open"):
        flusher.start()
        time.sleep(0.05)
        child_pid = os.fork()
    # The child leaves the block too, ending its inherited copy of "parent.open": that must not export.
    if child_pid == 0:
        code = 1
        try:
            with tel.managed_span("step", "child.span") as span:
                assert span is None and state.ENABLED_GROUPS == frozenset()
            with tel.span_cm("child.cold"):
                pass
            handle.force_flush(500)
            handle.shutdown(timeout_ms=500)
            code = 0
        finally:
            os._exit(code)
    assert _wait(child_pid, timeout_s=10) == 0
    flusher.join(5)
    with tel.managed_span("step", "parent.after_fork"):
        pass
    handle.shutdown(timeout_ms=3000)
    lines = path.read_text().split("\n")
    pids = {line.split()[0] for line in lines if line}
    names = sorted(line.split()[1] for line in lines if line)
    assert pids == {str(os.getpid())}
    assert names == ["parent.after_fork", "parent.before_fork", "parent.open"]


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_leaves_the_parents_open_spans_to_the_parent(tmp_path):
    """A child that shuts down the providers it inherited (a worker tearing telemetry down, atexit
    code) neither ends, marks nor exports the parent's open spans through the open-span tracker."""
    from megatron.core.telemetry.providers import TRUNCATED_ATTR, shutdown_providers

    path = tmp_path / "spans.txt"
    handle = tel.setup_telemetry(tel.TelemetryConfig(enabled=True, span_groups="all", metrics_enabled=False), 0, 1,
                                 span_exporter=FileExporter(path))
    providers = handle._providers
    with tel.managed_span("job", "parent.open") as span:
        child_pid = os.fork()
        if child_pid == 0:
            code = 1
            try:
                ended = providers.span_tracker.end_open_spans()
                finished = shutdown_providers(providers, timeout_ms=500)
                providers.span_tracker.force_flush(500)
                untouched = span.end_time is None and TRUNCATED_ATTR not in (span.attributes or {})
                code = 0 if (ended == 0 and finished and untouched) else 2
            finally:
                os._exit(code)
        assert _wait(child_pid, timeout_s=30) == 0
    handle.shutdown(timeout_ms=3000)
    lines = [line.split() for line in path.read_text().splitlines() if line]
    assert lines == [[str(os.getpid()), "parent.open"]]  # once, by the parent
    assert TRUNCATED_ATTR not in span.attributes  # it ended normally in the parent
