"""TelemetryConfig: prefix/fallback rule, strict parsing, validation messages, CLI overrides."""
import pytest

from megatron.core.telemetry import MegatronSpanGroup, SpanGroup, TelemetryConfig, otlp_protocol, parse_bool
from telemetry_testutil import clean_telemetry  # noqa: F401  (autouse fixture)


def test_defaults_match_spec():
    cfg = TelemetryConfig.from_env(environ={})
    assert (cfg.enabled, cfg.rank_strategy, cfg.export_rank, cfg.export_sample_rate) == (False, "single_rank", -1, 1.0)
    assert (cfg.sampling_strategy, cfg.traces_enabled, cfg.metrics_enabled, cfg.logs_enabled) == ("", True, True, False)
    assert (cfg.span_groups, cfg.exporter, cfg.run_id, cfg.user_id) == ("default", "otlp", None, "")
    assert cfg.service_name == "megatron-lm" and cfg.span_group_cls is MegatronSpanGroup
    cfg.validate()


def test_prefixed_zero_beats_fallback_one_and_blank_falls_back():
    env = {"MEGATRON_OTEL_ENABLED": "0", "NEMO_LENS_ENABLED": "1"}
    assert TelemetryConfig.from_env(environ=env).enabled is False
    env = {"MEGATRON_OTEL_ENABLED": "  ", "NEMO_LENS_ENABLED": "1", "NEMO_LENS_EXPORT_RANK": "3"}
    cfg = TelemetryConfig.from_env(environ=env)
    assert cfg.enabled is True and cfg.export_rank == 3
    assert cfg.sources["enabled"] == "NEMO_LENS_ENABLED"


def test_custom_prefixes_and_no_fallback():
    env = {"MY_ENABLED": "yes", "NEMO_LENS_LOGS_ENABLED": "1"}
    cfg = TelemetryConfig.from_env(prefix="MY", fallback_prefix=None, span_group_cls=SpanGroup, environ=env)
    assert cfg.enabled and not cfg.logs_enabled and cfg.span_group_cls is SpanGroup


@pytest.mark.parametrize("text,value", [("1", True), ("TRUE", True), ("Yes", True), (" on ", True),
                                        ("0", False), ("false", False), ("NO", False), ("Off", False)])
def test_boolean_spellings(text, value):
    assert parse_bool(text, "X") is value
    assert TelemetryConfig.from_env(environ={"MEGATRON_OTEL_TRACES_ENABLED": text}).traces_enabled is value


@pytest.mark.parametrize("var,value,fragment", [
    ("MEGATRON_OTEL_ENABLED", "maybe", "Invalid boolean for MEGATRON_OTEL_ENABLED: 'maybe'. Expected '1'/'0', 'true'/'false', 'yes'/'no', 'on'/'off'."),
    ("NEMO_LENS_METRICS_ENABLED", "2", "Invalid boolean for NEMO_LENS_METRICS_ENABLED"),
    ("MEGATRON_OTEL_EXPORT_RANK", "last", "Invalid integer for MEGATRON_OTEL_EXPORT_RANK: 'last'."),
    ("MEGATRON_OTEL_EXPORT_RANK", "1.5", "Invalid integer for"),
    ("MEGATRON_OTEL_EXPORT_SAMPLE_RATE", "half", "Invalid float for MEGATRON_OTEL_EXPORT_SAMPLE_RATE"),
    ("MEGATRON_OTEL_EXPORT_SAMPLE_RATE", "nan", "Invalid float for"),
    ("MEGATRON_OTEL_EXPORT_SAMPLE_RATE", "1.5", ": export_sample_rate must be in [0.0, 1.0], got 1.5"),  # refused by from_env itself
    ("MEGATRON_OTEL_EXPORT_SAMPLE_RATE", "-0.1", "must be in [0.0, 1.0]"),
])
def test_parse_errors_name_the_variable(var, value, fragment):
    with pytest.raises(ValueError) as err:
        TelemetryConfig.from_env(environ={var: value})
    assert var in str(err.value) and fragment in str(err.value)


@pytest.mark.parametrize("env,fragment", [
    ({"MEGATRON_OTEL_RANK_STRATEGY": "every"},
     "MEGATRON_OTEL_RANK_STRATEGY: Unknown export_strategy 'every'. Registered strategies: single_rank, all_ranks, sampled, "
     "first_rank_per_node"),
    ({"NEMO_LENS_EXPORT_STRATEGY": "every"}, "NEMO_LENS_EXPORT_STRATEGY: Unknown export_strategy 'every'"),
    ({"MEGATRON_OTEL_SAMPLING_STRATEGY": "ratio"}, "is not a sampling strategy; valid choices: (empty), rank_aware"),
    ({"MEGATRON_OTEL_EXPORTER": "jaeger"}, "MEGATRON_OTEL_EXPORTER: Unknown exporter type: 'jaeger'. Expected one of: otlp, console"),
    ({"MEGATRON_OTEL_SPAN_GROUPS": "default,bogus"}, "MEGATRON_OTEL_SPAN_GROUPS: Unknown span group or preset: 'bogus'"),
])
def test_validation_errors_name_variable_and_choices(env, fragment):
    cfg = TelemetryConfig.from_env(environ=env)  # names are checked by validate(), on every rank
    with pytest.raises(ValueError) as err:
        cfg.validate()
    assert fragment in str(err.value)


def test_validation_runs_when_disabled():
    cfg = TelemetryConfig.from_env(environ={"MEGATRON_OTEL_ENABLED": "0", "MEGATRON_OTEL_SPAN_GROUPS": "nope"})
    with pytest.raises(ValueError, match="Valid options: all, default, full, per_step, profiling"):
        cfg.validate()


def test_rank_strategy_alias_and_conflict():
    assert TelemetryConfig.from_env(environ={"MEGATRON_OTEL_EXPORT_STRATEGY": "ALL_RANKS"}).rank_strategy == "all_ranks"
    with pytest.raises(ValueError, match="MEGATRON_OTEL_RANK_STRATEGY='sampled' and MEGATRON_OTEL_EXPORT_STRATEGY="):
        TelemetryConfig.from_env(environ={"MEGATRON_OTEL_RANK_STRATEGY": "sampled",
                                          "MEGATRON_OTEL_EXPORT_STRATEGY": "all_ranks"})
    # The prefixed spelling of either alias beats the fallback prefix.
    cfg = TelemetryConfig.from_env(environ={"MEGATRON_OTEL_EXPORT_STRATEGY": "sampled",
                                            "NEMO_LENS_RANK_STRATEGY": "all_ranks"})
    assert cfg.rank_strategy == "sampled"


def test_run_and_user_id_and_service_name_precedence():
    env = {"NEMO_LENS_RUN_ID": "r1", "NEMO_LENS_USER_ID": "team-a", "OTEL_SERVICE_NAME": "svc"}
    cfg = TelemetryConfig.from_env(environ=env)
    assert (cfg.run_id, cfg.user_id, cfg.service_name) == ("r1", "team-a", "svc")
    assert TelemetryConfig.from_env(environ={**env, "MEGATRON_OTEL_RUN_ID": "r0"}).run_id == "r0"
    cli = cfg.with_overrides(service_name="cli-svc")
    assert cli.service_name == "cli-svc" and cfg.service_name == "svc"


def test_cli_overrides_win_and_errors_name_the_flag():
    cfg = TelemetryConfig.from_env(environ={"MEGATRON_OTEL_ENABLED": "0", "MEGATRON_OTEL_SPAN_GROUPS": "all"})
    over = cfg.with_overrides(enabled=True, span_groups="per_step")
    assert over.enabled and over.resolved_span_groups() == MegatronSpanGroup.presets()["per_step"]
    with pytest.raises(ValueError, match="--otel-span-groups: Unknown span group"):
        cfg.with_overrides(span_groups="steps").validate()
    with pytest.raises(ValueError, match="--otel-service-name"):
        cfg.with_overrides(service_name=" ").validate()


def test_otlp_protocol_rules(monkeypatch):
    assert otlp_protocol("traces", {}) == "grpc"
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc"}
    assert otlp_protocol("traces", env) == "http/protobuf" and otlp_protocol("metrics", env) == "grpc"
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_LOGS_PROTOCOL='http/json' is not supported"):
        otlp_protocol("logs", {"OTEL_EXPORTER_OTLP_LOGS_PROTOCOL": "http/json"})
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "thrift")
    with pytest.raises(ValueError, match="valid choices: grpc, http/protobuf"):
        TelemetryConfig(enabled=True).validate()
    TelemetryConfig(enabled=True, exporter="console").validate()  # console needs no protocol


def test_from_env_rejects_a_non_spangroup_class():
    with pytest.raises(TypeError, match="SpanGroup subclass"):
        TelemetryConfig.from_env(span_group_cls=dict, environ={})
