"""OTEL_EXPORTER_OTLP_*HEADERS: a malformed value stops start-up naming the variable, never showing it,
and never reaches the OpenTelemetry SDK (which would print it, secret included)."""
import argparse
import logging

import pytest

from megatron.core import telemetry as tel
from megatron.training import argument_utils
from telemetry_testutil import clean_telemetry  # noqa: F401  (autouse fixture)

SECRET = "s3cret-T0KEN"
HEADER_VARIABLES = ["OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
                    "OTEL_EXPORTER_OTLP_METRICS_HEADERS", "OTEL_EXPORTER_OTLP_LOGS_HEADERS"]

# (value, what the message must say); each value carries the secret somewhere.
MALFORMED = [
    (f"authorization: Bearer {SECRET}", "entry 1 has no '='"),
    (f"x-team=ml,authorization: Bearer {SECRET}", "entry 2 has no '='"),
    (f"=Bearer {SECRET}", "entry 1 has no name before '='"),
    (f"auth {SECRET}=1", "entry 1: the name holds a space"),
    (f"authorization=Bearer {SECRET};v=1", "entry 1: the value holds ';'"),
    (f'authorization="Bearer {SECRET}"', "entry 1: the value holds '\"'"),
    (f"authorization=Bearer\t{SECRET}", "entry 1: the value holds a control character (U+0009)"),
    (f"authorization=Bearer {SECRET}\u00e9", "entry 1: the value holds a non-ASCII character"),
    (f"authoriz\u00e4tion=Bearer {SECRET}", "entry 1: the name holds a non-ASCII character"),
    (f"authorization=Bearer%20{SECRET},\n", "entry 2 is blank"),
    (" ", "entry 1 is blank"),
]
WELL_FORMED = [
    "", "authorization=Bearer%20" + SECRET, "authorization=Bearer " + SECRET, "a=1,b=2", " a = 1 ,, b=x=y ",
    "x-api-key=" + SECRET + "%3D%3D", "k=", "api-key=abc!#$%&'()*+-./:<=>?@[]^_`{|}~",
]


def _sdk_accepts(value):
    """The SDK's own verdict: its (liberal) parser keeps every non-empty entry and warns about none."""
    from opentelemetry.util import re as otel_re

    records = []

    class Catch(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger(otel_re.__name__)
    handler, propagate = Catch(), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False  # the SDK's warning would print the value
    try:
        otel_re.parse_env_headers(value, liberal=True)
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
    return not records


@pytest.mark.parametrize("value", [v for v, _ in MALFORMED] + WELL_FORMED,
                         ids=[f"malformed{i}" for i in range(len(MALFORMED))] +
                         [f"well_formed{i}" for i in range(len(WELL_FORMED))])
def test_verdict_matches_the_sdk_parser(value):
    from megatron.core.telemetry.config import otlp_headers_problem

    assert (otlp_headers_problem(value) is None) == _sdk_accepts(value)


@pytest.mark.parametrize("variable", HEADER_VARIABLES)
@pytest.mark.parametrize("value,problem", MALFORMED, ids=[f"malformed{i}" for i in range(len(MALFORMED))])
def test_malformed_headers_fail_validation_without_the_value(monkeypatch, variable, value, problem):
    monkeypatch.setenv(variable, value)
    config = tel.TelemetryConfig(enabled=True, exporter="otlp")
    with pytest.raises(ValueError) as info:
        config.validate()
    message = str(info.value)
    assert message.startswith(f"{variable} is malformed: {problem}"), message
    assert SECRET not in message and "Bearer" not in message and "authoriz" not in message


@pytest.mark.parametrize("value", WELL_FORMED, ids=[f"well_formed{i}" for i in range(len(WELL_FORMED))])
def test_well_formed_headers_pass(monkeypatch, value):
    for variable in HEADER_VARIABLES:
        monkeypatch.setenv(variable, value)
    tel.TelemetryConfig(enabled=True, exporter="otlp").validate()


def test_headers_are_not_checked_when_no_otlp_exporter_reads_them(monkeypatch):
    """As the OTLP protocol variables: only an enabled OTLP exporter reads them."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization: Bearer {SECRET}")
    tel.TelemetryConfig(enabled=False).validate()
    tel.TelemetryConfig(enabled=True, exporter="console").validate()


@pytest.fixture
def sdk_header_parsers(monkeypatch):
    """Every value the OTLP exporters (gRPC and HTTP) hand to the SDK's header parser."""
    from opentelemetry.exporter.otlp.proto.grpc import exporter as grpc_exporter
    from opentelemetry.exporter.otlp.proto.http import _common as http_common

    seen = []
    for module in (grpc_exporter, http_common):
        real = module.parse_env_headers

        def spy(value, *args, _real=real, **kwargs):
            seen.append(value)
            return _real(value, *args, **kwargs)

        monkeypatch.setattr(module, "parse_env_headers", spy)
    return seen


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_start_up_fails_on_every_rank_and_the_secret_is_never_printed(monkeypatch, capfd, sdk_header_parsers,
                                                                      protocol):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization: Bearer {SECRET}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("MEGATRON_OTEL_ENABLED", "1")
    args = argparse.Namespace(otel_enabled=False, otel_service_name=None, otel_span_groups=None, rank=0,
                              world_size=2)
    for rank in (0, 1):  # rank 1 exports (single_rank = last rank), rank 0 does not: both stop
        with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_HEADERS is malformed: entry 1 has no '='"):
            argument_utils.setup_telemetry_from_args(args, rank=rank, world_size=2)
    # Even a caller that skips validation cannot hand the value to an exporter.
    from megatron.core.telemetry.providers import build_providers

    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_HEADERS is malformed"):
        build_providers(tel.TelemetryConfig(enabled=True, exporter="otlp"), {})
    assert sdk_header_parsers == []
    out, err = capfd.readouterr()
    assert SECRET not in out + err and "Bearer" not in out + err


def test_well_formed_headers_still_reach_the_exporter(monkeypatch, sdk_header_parsers):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization=Bearer%20{SECRET}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    from megatron.core.telemetry.providers import build_providers, shutdown_providers

    config = tel.TelemetryConfig(enabled=True, exporter="otlp", metrics_enabled=False)
    providers = build_providers(config, {})
    try:
        assert sdk_header_parsers == [f"authorization=Bearer%20{SECRET}"]
    finally:
        shutdown_providers(providers, 1000)
