"""Span helpers against the SDK's in-memory exporter: gating, nesting, exceptions, attribute filtering."""
import numpy as np
import pytest
import torch

from megatron.core import telemetry as tel
from megatron.core.telemetry import helpers, state
from telemetry_testutil import clean_telemetry, finished, setup_in_memory  # noqa: F401


class SpyTracer:
    """Counts every call: a gated helper on a disabled path must make none."""

    def __init__(self):
        self.calls = 0

    def start_as_current_span(self, *args, **kwargs):
        self.calls += 1
        raise AssertionError("no span may be created")

    start_span = start_as_current_span


def _count_sdk_spans(monkeypatch):
    from opentelemetry.sdk import trace as sdk_trace

    created = []
    original = sdk_trace.Span.__init__

    def counting_init(self, *args, **kwargs):
        created.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(sdk_trace.Span, "__init__", counting_init)
    return created


def test_disabled_creates_nothing_and_body_runs():
    spy = SpyTracer()
    ran = []
    assert not tel.is_span_group_enabled("job")
    with tel.managed_span("job", "megatron.pretrain", tracer=spy, **{"megatron.train_iters": 3}) as span:
        ran.append(span)
    assert ran == [None] and spy.calls == 0
    assert tel.managed_span("step", "a") is tel.managed_span("layer", "b")  # one shared no-op object

    @tel.trace_fn("step", "f")
    def f(x):
        return x + 1

    assert f(1) == 2 and spy.calls == 0
    with tel.create_linked_span("megatron.pp.recv_forward.linked", {"traceparent": "x"}, tracer=spy) as span:
        assert span is None


def test_disabled_config_builds_no_sdk_objects(monkeypatch):
    created = _count_sdk_spans(monkeypatch)
    handle = tel.setup_telemetry(tel.TelemetryConfig(enabled=False, span_groups="all"), 0, 1)
    assert not handle.is_exporting and handle.tracer_provider is None and state.ENABLED_GROUPS == frozenset()
    with tel.managed_span("step", "s"):
        with tel.span_cm("cold"):
            pass
    assert created == []


def test_non_exporting_rank_creates_no_span_objects(monkeypatch):
    created = _count_sdk_spans(monkeypatch)
    detected = []
    monkeypatch.setattr("megatron.core.telemetry.handle.detect_resource_attributes",
                        lambda **kw: detected.append(kw) or {})
    handle = tel.setup_telemetry(tel.TelemetryConfig(enabled=True, span_groups="all"), rank=0, world_size=4)
    assert handle.enabled and not handle.is_exporting and handle.meter_provider is None
    assert handle.tracer is tel.fallbacks.NOOP_TRACER and tel.get_enabled_groups() == frozenset()
    with tel.managed_span("job", "megatron.pretrain") as span:
        assert span is None
    with tel.span_cm("megatron.save_checkpoint") as span:
        assert span is tel.fallbacks.NOOP_SPAN
    assert tel.record_training_metrics(handle.meter, loss=1.0) == 1  # no-op meter accepts it
    assert created == [] and detected == []
    with pytest.raises(RuntimeError, match="already been initialised"):
        tel.setup_telemetry(tel.TelemetryConfig(enabled=True), rank=0, world_size=4)


def test_nesting_attributes_and_group_selection():
    cfg = tel.TelemetryConfig(enabled=True, span_groups="per_step")
    handle, spans, _ = setup_in_memory(cfg)
    with tel.managed_span("job", "megatron.pretrain", **{"megatron.train_iters": 10}) as root:
        assert root.is_recording()
        with tel.managed_span("step", "megatron.train_step", **{"megatron.iteration": 1}):
            with tel.managed_span("microbatch", "megatron.microbatch.forward") as off:
                assert off is None  # not in per_step
            with tel.managed_span("optimizer", "megatron.optimizer_step") as opt:
                tel.safe_set_span_attributes(opt, {"megatron.update_successful": True, "megatron.grad_norm": 1.5})
    got = finished(handle, spans)
    assert set(got) == {"megatron.pretrain", "megatron.train_step", "megatron.optimizer_step"}
    assert got["megatron.train_step"].parent.span_id == got["megatron.pretrain"].context.span_id
    assert got["megatron.optimizer_step"].parent.span_id == got["megatron.train_step"].context.span_id
    assert dict(got["megatron.optimizer_step"].attributes) == {"megatron.update_successful": True,
                                                               "megatron.grad_norm": 1.5}
    assert got["megatron.pretrain"].attributes["megatron.train_iters"] == 10
    # Groups can be switched at run time (e.g. first_iteration only for the first step).
    tel.set_enabled_groups(tel.get_enabled_groups() | {"first_iteration"})
    with tel.managed_span("first_iteration", "megatron.first_iteration"):
        pass
    assert "megatron.first_iteration" in finished(handle, spans)


def test_exceptions_are_recorded_and_reraised():
    handle, spans, _ = setup_in_memory()
    with pytest.raises(KeyError):
        with tel.managed_span("step", "megatron.train_step"):
            raise KeyError("boom")

    @tel.trace_fn("optimizer")
    def failing():
        raise ValueError("bad")

    with pytest.raises(ValueError):
        failing()
    got = finished(handle, spans)
    from opentelemetry.trace import StatusCode

    for name, exc_type in (("megatron.train_step", "KeyError"),
                           (f"{__name__}.test_exceptions_are_recorded_and_reraised.<locals>.failing", "ValueError")):
        span = got[name]
        assert span.status.status_code == StatusCode.ERROR
        assert [e.name for e in span.events] == ["exception"]
        assert span.events[0].attributes["exception.type"] == exc_type


def test_span_cm_always_makes_a_span_and_context_parent():
    handle, spans, _ = setup_in_memory(tel.TelemetryConfig(enabled=True, span_groups=""))
    assert tel.get_enabled_groups() == frozenset()
    ctx = tel.iteration_trace_context("run-x", 7)
    with tel.span_cm("megatron.save_checkpoint", context=ctx, **{"megatron.iteration": 7}):
        pass
    span = finished(handle, spans)["megatron.save_checkpoint"]
    trace_id, parent_id = tel.iteration_span_ids("run-x", 7)
    assert span.context.trace_id == trace_id and span.parent.span_id == parent_id and span.parent.is_remote


def test_attribute_filtering_and_redaction():
    attrs = {
        "b": True, "i": 3, "f": 2.5, "s": "x", "ints": [1, 2], "strs": ("a", "b"), "empty": [],
        "mixed": [1, "a"], "bool_int": [True, 1], "none": None, "dict": {"a": 1}, "obj": object(),
        "t0": torch.tensor(1.25), "t1": torch.tensor([1.0, 2.0]), "np0": np.float32(0.5), "np1": np.arange(3),
        "tlist": [torch.tensor(1), torch.tensor(2)], 3: "non-string key",
        "hf_token": "abc", "db.password": "p", "OPENAI_API_KEY": "k", "Authorization": "Bearer x",
        "aws.secret_access_key": "s", "megatron.tokens_per_sec": 10.0, "tokenizer.type": "gpt2",
    }
    clean = tel.sanitize_attributes(attrs)
    assert clean == {
        "b": True, "i": 3, "f": 2.5, "s": "x", "ints": [1, 2], "strs": ["a", "b"], "empty": [],
        "t0": 1.25, "np0": 0.5, "tlist": [1, 2], "hf_token": "[REDACTED]", "db.password": "[REDACTED]",
        "OPENAI_API_KEY": "[REDACTED]", "Authorization": "[REDACTED]", "aws.secret_access_key": "[REDACTED]",
        "megatron.tokens_per_sec": 10.0, "tokenizer.type": "gpt2",
    }
    handle, spans, _ = setup_in_memory()
    with tel.managed_span("step", "s", **{"api_key": "k", "megatron.loss": torch.tensor(2.0)}) as span:
        assert tel.safe_set_span_attributes(span, {"x": [1.0, 2.0]}, y=None) is None  # as nemo-lens
    assert tel.safe_set_span_attributes(None, {"x": 1}) is None
    got = finished(handle, spans)["s"]
    assert dict(got.attributes) == {"api_key": "[REDACTED]", "megatron.loss": 2.0, "x": (1.0, 2.0)}


def test_helpers_module_has_no_sdk_import():
    source = open(helpers.__file__).read()
    assert "opentelemetry" not in source
