"""The nemo-lens API and observability-contract items that were missing or partial (issue 32, item 5):
``helpers.redact_value``, nemo-lens's error wording where callers match it, ``NemoLensConfig`` with
``from_env()``, ``first_iteration`` in the default span groups (coarse spans only when nothing is set),
and the ``trace_region`` helper for user code."""
import json
import os
import subprocess
import sys

import pytest

from megatron.core import telemetry as tel
from megatron.core.telemetry import helpers
from megatron.core.telemetry.groups import SpanGroup
from pretrain_utils import REPO
from telemetry_testutil import clean_telemetry, finished, setup_in_memory  # noqa: F401


# ------------------------------------------------------------------------------------ redact_value
def test_redact_value_as_nemo_lens_calls_it():
    assert helpers.redact_value("prompt", "hello") == "[REDACTED]"  # a default content key
    assert helpers.redact_value("megatron.loss", "2.5") == "2.5"
    assert helpers.redact_value("text", "t", frozenset({"other"})) == "t"  # the caller's keys replace the defaults
    assert helpers.redact_value("other", "t", frozenset({"other"})) == "[REDACTED]"
    # ours, on purpose wider (docs/observability.md): a dotted key's last part, and secrets whatever the keys
    assert helpers.redact_value("gen_ai.prompt", "p") == "[REDACTED]"
    assert helpers.redact_value("x-api-key", 42, frozenset()) == "[REDACTED]"
    assert helpers.redact_value("count", 3) == 3 and tel.redact_value is helpers.redact_value


# ---------------------------------------------------------------------------- nemo-lens's messages
def _registered(name):
    tel.register_rank_strategy(name, lambda config, rank, world_size: True)


# (what raises, the exception, the pattern nemo-lens's own tests or its exact wording match)
NEMO_LENS_MESSAGES = [
    (lambda: tel.TelemetryConfig.from_env(environ={"NEMO_LENS_ENABLED": "maybe"}), ValueError,
     r"Invalid boolean for NEMO_LENS_ENABLED: 'maybe'\. Expected '1'/'0', 'true'/'false', 'yes'/'no', 'on'/'off'\."),
    (lambda: tel.TelemetryConfig.from_env(environ={"NEMO_LENS_EXPORT_RANK": "x"}), ValueError,
     r"Invalid integer for NEMO_LENS_EXPORT_RANK: 'x'\."),
    (lambda: tel.TelemetryConfig.from_env(environ={"NEMO_LENS_EXPORT_SAMPLE_RATE": "x"}), ValueError,
     r"Invalid float for NEMO_LENS_EXPORT_SAMPLE_RATE: 'x'\."),
    (lambda: tel.TelemetryConfig(export_sample_rate=1.5), ValueError,
     r"^export_sample_rate must be in \[0\.0, 1\.0\], got 1\.5$"),
    (lambda: SpanGroup.resolve("bogus"), ValueError, r"Unknown span group or preset: 'bogus'\. Valid options: "),
    (lambda: tel.TelemetryConfig(rank_strategy="every").validate(), ValueError,
     r"Unknown export_strategy 'every'\. Registered strategies: single_rank, "),
    (lambda: tel.TelemetryConfig(exporter="jaeger").validate(), ValueError,
     r"Unknown exporter type: 'jaeger'\. Expected one of: otlp, console"),
    (lambda: tel.register_rank_strategy("", lambda c, r, w: True), ValueError, r"Strategy name must be a non-empty string"),
    (lambda: (_registered("twice"), _registered("twice")), ValueError,
     r"Strategy 'twice' is already registered\. Pass allow_override=True to replace it\."),
    (lambda: tel.unregister_rank_strategy("single_rank"), ValueError, r"Cannot unregister built-in strategy 'single_rank'\."),
    (lambda: tel.unregister_rank_strategy("nobody"), ValueError, r"Strategy 'nobody' is not registered\."),
]


@pytest.mark.parametrize("call,error,pattern", NEMO_LENS_MESSAGES)
def test_error_messages_match_what_nemo_lens_callers_match(call, error, pattern):
    try:
        with pytest.raises(error, match=pattern):
            call()
    finally:
        for name in ("twice",):
            if name in tel.registered_rank_strategies():
                tel.unregister_rank_strategy(name)


def test_double_setup_message_is_nemo_lens_s():
    handle, _, _ = setup_in_memory()
    with pytest.raises(RuntimeError, match=r"setup_telemetry\(\) has already been initialised for this process"):
        setup_in_memory()
    handle.shutdown(timeout_ms=2000)


# ---------------------------------------------------------------------------------- NemoLensConfig
def test_nemo_lens_config_names_and_from_env():
    config = tel.NemoLensConfig(enabled=True, export_strategy="all_ranks", user="team-a", span_groups="per_step")
    assert isinstance(config, tel.TelemetryConfig)
    assert (config.rank_strategy, config.export_strategy, config.user_id, config.user) == ("all_ranks",) * 2 + ("team-a",) * 2
    config.export_strategy = "sampled"
    assert config.rank_strategy == "sampled"
    # nemo-lens's defaults: NEMO_LENS_* with no fallback, the base span groups
    env = {"NEMO_LENS_ENABLED": "1", "NEMO_LENS_EXPORT_STRATEGY": "all_ranks", "NEMO_LENS_USER_ID": "me",
           "MEGATRON_OTEL_EXPORTER": "console"}
    loaded = tel.NemoLensConfig.from_env(environ=env)
    assert type(loaded) is tel.NemoLensConfig and loaded.validate() is loaded
    assert (loaded.enabled, loaded.export_strategy, loaded.user, loaded.exporter) == (True, "all_ranks", "me", "otlp")
    assert loaded.resolved_span_groups() == frozenset({"job", "checkpoint", "evaluate"})
    with pytest.raises(ValueError, match="Unknown span group or preset: 'microbatch'"):
        tel.NemoLensConfig.from_env(environ={"NEMO_LENS_SPAN_GROUPS": "microbatch"}).validate()  # not a base group
    # Megatron's call shape, as Megatron-LM's global_vars passes it
    megatron = tel.NemoLensConfig.from_env("MEGATRON_OTEL", "NEMO_LENS", tel.MegatronSpanGroup, environ=env)
    assert megatron.exporter == "console" and "first_iteration" in megatron.resolved_span_groups()
    assert megatron.with_overrides(enabled=False).export_strategy == "all_ranks"
    with pytest.raises(TypeError, match="not both"):
        tel.NemoLensConfig(export_strategy="all_ranks", rank_strategy="sampled")


# --------------------------------------------------------------------------- default span groups
def test_default_groups_are_the_contracts_coarse_ones():
    default = tel.TelemetryConfig().resolved_span_groups()
    assert default == frozenset({"job", "checkpoint", "evaluate", "first_iteration", "inference"})
    assert tel.TelemetryConfig.from_env(environ={}).resolved_span_groups() == default


@pytest.mark.timeout(300)
def test_a_run_with_nothing_set_emits_coarse_spans_and_the_first_step(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), MEGATRON_OTEL_ENABLED="1",
               MEGATRON_OTEL_EXPORTER="console", MEGATRON_OTEL_METRICS_ENABLED="0")
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
             "--train-iters", "3", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "128", "--distributed-backend", "gloo", "--log-interval", "1", "--eval-iters", "0"]
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *flags], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    spans = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"name":')]
    names = [span["name"] for span in spans]
    steps = [span for span in spans if span["name"] == "megatron.train_step"]
    assert [span["attributes"]["megatron.iteration"] for span in steps] == [1]  # the first iteration only
    assert {"megatron.pretrain", "megatron.train"} <= set(names)
    assert not {"megatron.forward_backward", "megatron.optimizer_step", "megatron.model_init"} & set(names)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -------------------------------------------------------------------------------------- trace_region
def test_trace_region_off_creates_nothing_and_runs_the_body():
    ran = []
    region = tel.trace_region("user.block", items=3)
    with region as span:
        ran.append(span)

    @tel.trace_region("user.fn")
    def work(x):
        return x * 2

    assert ran == [None] and work(2) == 4


def test_trace_region_on_is_a_child_span_with_attributes_and_errors():
    handle, spans, _ = setup_in_memory(tel.TelemetryConfig(enabled=True, span_groups="default,step,trace_region"))

    @tel.trace_region("user.decorated", kind="hook")
    def hook():
        return 7

    with tel.managed_span("step", "megatron.train_step"):
        with tel.trace_region("user.block", items=3, prompt="secret") as span:
            assert span is not None and span.is_recording()
            assert hook() == 7
        with pytest.raises(KeyError):
            with tel.trace_region("user.failing"):
                raise KeyError("x")
    got = finished(handle, spans)
    step, block, decorated, failing = (got[n] for n in ("megatron.train_step", "user.block", "user.decorated",
                                                        "user.failing"))
    assert block.parent.span_id == step.context.span_id and decorated.parent.span_id == block.context.span_id
    assert dict(block.attributes) == {"items": 3, "prompt": "[REDACTED]"} and decorated.attributes["kind"] == "hook"
    assert failing.status.status_code.name == "ERROR" and failing.events[0].name == "exception"


def test_trace_region_group_is_off_by_default_and_selectable():
    handle, spans, _ = setup_in_memory(tel.TelemetryConfig(enabled=True))  # the default groups
    with tel.trace_region("user.block"):
        pass
    with tel.trace_region("user.in_job_group", group="job"):
        pass
    assert set(finished(handle, spans)) == {"user.in_job_group"}
