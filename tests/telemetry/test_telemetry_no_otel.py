"""With the OpenTelemetry packages hidden, everything imports and is harmless; setup reports one warning."""
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(r'''
    import importlib.abc, logging, sys
    from argparse import Namespace

    class Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("opentelemetry", "grpc", "pynvml"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Hide())
    records = []
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger().addHandler(type("H", (logging.Handler,), {"emit": lambda self, r: records.append(r)})())

    from megatron.core import telemetry as tel
    from megatron.core.telemetry import fallbacks
    from megatron.training import argument_utils

    # gated helpers: body runs, nothing emitted
    with tel.managed_span("step", "s") as span:
        assert span is None
    with tel.span_cm("cold") as span:
        assert span is fallbacks.NOOP_SPAN
    assert tel.trace_fn("step")(lambda: 5)() == 5
    assert tel.inject_context() == {} and tel.extract_context({"traceparent": "00-x"}) is None
    assert tel.iteration_trace_context("r", 1) is None
    assert tel.record_training_metrics(None, loss=1.0) == 0
    assert tel.sanitize_attributes({"a": 1, "token": "x"}) == {"a": 1, "token": "[REDACTED]"}
    h = tel.setup_telemetry(tel.TelemetryConfig(enabled=False), 0, 1)
    assert not h.is_exporting
    h.shutdown()
    try:
        tel.setup_telemetry(tel.TelemetryConfig(enabled=True, rank_strategy="all_ranks"), 0, 1)
        raise SystemExit("expected ImportError")
    except ImportError:
        pass
    tel.state.deactivate()
    args = Namespace(otel_enabled=True, otel_service_name=None, otel_span_groups=None, local_rank=0)
    assert argument_utils.setup_telemetry_from_args(args, 0, 1, 0) is None
    assert argument_utils.setup_telemetry_from_args(args, 0, 1, 0) is None
    warnings = [r for r in records if "OpenTelemetry cannot be imported" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in records]
    assert not [m for m in sys.modules if m.startswith("opentelemetry")]
    for name in fallbacks.__all__:
        getattr(fallbacks, name)
    print("OK")
''')


def test_everything_harmless_without_opentelemetry():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("OK")


def test_only_providers_imports_the_sdk():
    pkg = REPO / "megatron" / "core" / "telemetry"
    importing = sorted(p.relative_to(pkg).as_posix() for p in pkg.rglob("*.py")
                       if "from opentelemetry.sdk" in p.read_text() or "import opentelemetry.sdk" in p.read_text())
    assert importing == ["console_format.py", "metric_reader.py", "prometheus_reader.py", "providers.py"]
    # the readers and the console formatter are reached only through providers, which exporting ranks alone
    # import (prometheus_reader imports the SDK inside a function, at export time)
    for module in ("metric_reader", "console_format", "prometheus_reader"):
        users = sorted(p.relative_to(pkg).as_posix() for p in pkg.rglob("*.py")
                       if f"from .{module} import" in p.read_text() and p.name != f"{module}.py")
        assert users == ["providers.py"], module
    assert "opentelemetry" not in (pkg / "config.py").read_text()
