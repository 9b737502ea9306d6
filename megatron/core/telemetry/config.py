"""Telemetry configuration: the ``TelemetryConfig`` dataclass, strict environment parsing, validation."""
from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Dict, FrozenSet, Mapping, Optional, Tuple

from .groups import SpanGroup
from .span_groups import MegatronSpanGroup

__all__ = ["TelemetryConfig", "effective_sampling_strategy", "parse_bool", "otlp_protocol", "otlp_headers_problem",
           "check_otlp_headers", "EXPORTERS", "OTLP_PROTOCOLS", "OTLP_HEADER_VARIABLES"]

EXPORTERS: Tuple[str, ...] = ("otlp", "console")
# MEGATRON_OTEL_METRICS_EXPORTER: empty = the EXPORTER's; "prometheus" = a pull endpoint on each exporting rank.
METRICS_EXPORTERS: Tuple[str, ...] = ("", "otlp", "console", "prometheus")
OTLP_PROTOCOLS: Tuple[str, ...] = ("grpc", "http/protobuf")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(value: str, name: str) -> bool:
    """Parse 1/0, true/false, yes/no, on/off (any case, surrounding blanks ignored).

    Raises ``ValueError`` naming ``name`` (the variable or flag) and the accepted spellings.
    """
    token = str(value).strip().lower()
    if token in _TRUE:
        return True
    if token in _FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean; valid choices: 1/0, true/false, yes/no, on/off")


def otlp_protocol(signal: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """OTLP transport for ``signal`` (``traces``/``metrics``/``logs``): ``OTEL_EXPORTER_OTLP_<SIGNAL>_PROTOCOL``,
    else ``OTEL_EXPORTER_OTLP_PROTOCOL``, else ``grpc`` (the Python SDK's default).

    Raises ``ValueError`` naming the variable and the valid choices for any other value.
    """
    env = os.environ if environ is None else environ
    for name in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        value = (env.get(name) or "").strip()
        if value:
            if value.lower() not in OTLP_PROTOCOLS:
                raise ValueError(f"{name}={value!r} is not supported; valid choices: {', '.join(OTLP_PROTOCOLS)}")
            return value.lower()
    return "grpc"


OTLP_HEADER_VARIABLES: Tuple[str, ...] = ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
                                          "OTEL_EXPORTER_OTLP_METRICS_HEADERS", "OTEL_EXPORTER_OTLP_LOGS_HEADERS")
# The OTLP exporter specification's header list: comma-separated name=value entries (W3C Baggage
# syntax), blanks and tabs allowed around names, values and commas. A name is an HTTP token; a
# value may hold spaces (the Python SDK's liberal reading) but no control, non-ASCII, '"', ',', ';'
# or '\\' character, which must be percent-encoded.
_HEADER_DELIMITER = re.compile(r"[ \t]*,[ \t]*")
_HEADER_NAME_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_HEADER_VALUE_FORBIDDEN = frozenset('",;\\')


def _describe_character(char: str) -> str:
    """A character of a header, named without revealing anything of a secret around it."""
    if ord(char) > 0x7E:
        return "a non-ASCII character" if ord(char) > 0x7F else "a control character (U+007F)"
    if ord(char) < 0x20:
        return f"a control character (U+{ord(char):04X})"
    return "a space" if char == " " else repr(char)


def otlp_headers_problem(value: str) -> Optional[str]:
    """What is wrong with an ``OTEL_EXPORTER_OTLP_*HEADERS`` value, or ``None`` when the SDK reads it whole.

    The answer names the entry (1-based) and the kind of fault, never any part of the value:
    headers carry credentials. An empty value or empty entries (``a=1,,b=2``) are fine: the SDK
    skips them.
    """
    for number, entry in enumerate(_HEADER_DELIMITER.split(value), start=1):
        if not entry:
            continue
        entry = entry.strip()
        if not entry:  # e.g. a newline between commas: the SDK reports it
            return f"entry {number} is blank"
        if "=" not in entry:
            return f"entry {number} has no '=' (expected name=value)"
        name, header_value = (part.strip(" \t") for part in entry.split("=", 1))
        if not name:
            return f"entry {number} has no name before '='"
        for char in name:
            if char not in _HEADER_NAME_CHARS:
                return f"entry {number}: the name holds {_describe_character(char)}, which a header name cannot"
        for char in header_value:
            if not " " <= char <= "~" or char in _HEADER_VALUE_FORBIDDEN:
                return f"entry {number}: the value holds {_describe_character(char)}, which must be percent-encoded"
    return None


def check_otlp_headers(environ: Optional[Mapping[str, str]] = None) -> None:
    """Check every set ``OTEL_EXPORTER_OTLP_HEADERS`` / ``_TRACES_`` / ``_METRICS_`` / ``_LOGS_HEADERS``.

    Raises ``ValueError`` naming the variable and what is wrong (see ``otlp_headers_problem``),
    without its value, so that the SDK, which prints a malformed value whole, never receives it.
    """
    env = os.environ if environ is None else environ
    for name in OTLP_HEADER_VARIABLES:
        problem = otlp_headers_problem(env.get(name) or "")
        if problem is not None:
            raise ValueError(f"{name} is malformed: {problem}; write comma-separated name=value pairs with "
                             "characters such as quotes or semicolons percent-encoded, e.g. x-api-key=abc%3Bdef "
                             "(the value is not shown: it may hold a credential)")


def _parse_int(value: str, name: str) -> int:
    try:
        return int(str(value).strip(), 10)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _parse_float(value: str, name: str) -> float:
    try:
        out = float(str(value).strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None
    if math.isnan(out):
        raise ValueError(f"{name}={value!r} is not a number")
    return out


def _check_sample_rate(rate, source: str) -> None:
    """``ValueError`` naming ``source`` unless ``rate`` is a number in [0, 1]."""
    try:
        ok = 0.0 <= float(rate) <= 1.0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{source}={rate!r} is outside [0, 1]")


def effective_sampling_strategy(config) -> str:
    """The SDK-level sampling strategy ``config`` asks for, lower case, ``""`` for none (the SDK's own
    ``OTEL_TRACES_SAMPLER``): ``sampler_enabled`` False (nemo-lens's ``SAMPLER_ENABLED=0``) means none
    whatever ``sampling_strategy`` says; True with no strategy named means ``rank_aware``; unset leaves
    it to ``sampling_strategy``."""
    switch = getattr(config, "sampler_enabled", None)
    if switch is False:
        return ""
    name = (getattr(config, "sampling_strategy", "") or "").strip().lower()
    return name or ("rank_aware" if switch else "")


@dataclasses.dataclass
class TelemetryConfig:
    """Everything that decides what telemetry a process emits (spec section 1).

    ``sources`` maps a field name to where its value came from (an environment variable or CLI
    flag) so that validation errors name the exact setting to fix.
    """

    enabled: bool = False
    rank_strategy: str = "single_rank"
    export_rank: int = -1
    export_sample_rate: float = 1.0
    sampling_strategy: str = ""
    # nemo-lens's switch for the SDK-level sampler: None = not set (the sampling strategy alone decides),
    # True = a sampler on exporting ranks (``sampling_strategy``, default ``rank_aware``), False = none.
    sampler_enabled: Optional[bool] = None
    traces_enabled: bool = True
    metrics_enabled: bool = True
    logs_enabled: bool = False
    span_groups: str = "default"
    exporter: str = "otlp"
    metrics_exporter: str = ""
    prometheus_host: str = "127.0.0.1"
    prometheus_port: int = 9464
    run_id: Optional[str] = None
    user_id: str = ""
    service_name: str = "megatron-lm"
    span_group_cls: type = MegatronSpanGroup
    sources: Dict[str, str] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Refused at construction (as nemo-lens does), not only by validate(): a config object with
        # an impossible rate never exists.
        _check_sample_rate(self.export_sample_rate, self.sources.get("export_sample_rate", "export_sample_rate"))

    @classmethod
    def from_env(
        cls,
        prefix: str = "MEGATRON_OTEL",
        fallback_prefix: Optional[str] = "NEMO_LENS",
        span_group_cls: type = MegatronSpanGroup,
        environ: Optional[Mapping[str, str]] = None,
    ) -> "TelemetryConfig":
        """Read ``{prefix}_<KEY>``, falling back to ``{fallback_prefix}_<KEY>`` when the prefixed
        variable is unset or blank, then the default (a prefixed ``0`` beats a fallback ``1``).

        ``RANK_STRATEGY`` has the alias ``EXPORT_STRATEGY``; the service name comes from
        ``OTEL_SERVICE_NAME``. Raises ``ValueError`` naming the variable for a malformed boolean,
        integer or float, or when both alias spellings are set to different values.
        Names (strategies, exporter, span groups) are checked by ``validate()``.
        """
        env = os.environ if environ is None else environ
        if not (isinstance(span_group_cls, type) and issubclass(span_group_cls, SpanGroup)):
            raise TypeError(f"span_group_cls must be a SpanGroup subclass, got {span_group_cls!r}")
        prefixes = [p for p in (prefix, fallback_prefix) if p]

        def read(*keys: str) -> Tuple[Optional[str], Optional[str]]:
            for pre in prefixes:
                found = [(f"{pre}_{k}", env.get(f"{pre}_{k}")) for k in keys]
                found = [(n, v) for n, v in found if v is not None and v.strip() != ""]
                if len({v.strip().lower() for _, v in found}) > 1:
                    raise ValueError(
                        " and ".join(f"{n}={v!r}" for n, v in found) + " disagree; set only one of them"
                    )
                if found:
                    return found[0][1], found[0][0]
            return None, None

        cfg = cls(span_group_cls=span_group_cls)
        specs = (
            ("enabled", ("ENABLED",), parse_bool),
            ("rank_strategy", ("RANK_STRATEGY", "EXPORT_STRATEGY"), lambda v, n: v.strip().lower()),
            ("export_rank", ("EXPORT_RANK",), _parse_int),
            ("export_sample_rate", ("EXPORT_SAMPLE_RATE",), _parse_float),
            ("sampling_strategy", ("SAMPLING_STRATEGY",), lambda v, n: v.strip().lower()),
            ("sampler_enabled", ("SAMPLER_ENABLED",), parse_bool),
            ("traces_enabled", ("TRACES_ENABLED",), parse_bool),
            ("metrics_enabled", ("METRICS_ENABLED",), parse_bool),
            ("logs_enabled", ("LOGS_ENABLED",), parse_bool),
            ("span_groups", ("SPAN_GROUPS",), lambda v, n: v),
            ("exporter", ("EXPORTER",), lambda v, n: v.strip().lower()),
            ("metrics_exporter", ("METRICS_EXPORTER",), lambda v, n: v.strip().lower()),
            ("prometheus_host", ("PROMETHEUS_HOST",), lambda v, n: v.strip()),
            ("prometheus_port", ("PROMETHEUS_PORT",), _parse_int),
            ("run_id", ("RUN_ID",), lambda v, n: v.strip()),
            ("user_id", ("USER_ID",), lambda v, n: v.strip()),
        )
        for field, keys, parse in specs:
            raw, name = read(*keys)
            if raw is not None:
                setattr(cfg, field, parse(raw, name))
                if field == "export_sample_rate":
                    _check_sample_rate(cfg.export_sample_rate, name)
                cfg.sources[field] = name
            else:
                cfg.sources[field] = f"{prefix}_{keys[0]}"
        service = env.get("OTEL_SERVICE_NAME", "")
        if service.strip():
            cfg.service_name = service.strip()
        cfg.sources["service_name"] = "OTEL_SERVICE_NAME"
        return cfg

    def with_overrides(
        self,
        enabled: Optional[bool] = None,
        service_name: Optional[str] = None,
        span_groups: Optional[str] = None,
    ) -> "TelemetryConfig":
        """A copy with command-line values applied (``None`` keeps the current value); CLI wins
        over every environment variable and errors then name the ``--otel-*`` flag."""
        out = dataclasses.replace(self, sources=dict(self.sources))
        if enabled is not None:
            out.enabled = bool(enabled)
            out.sources["enabled"] = "--otel-enabled"
        if service_name is not None:
            out.service_name = service_name
            out.sources["service_name"] = "--otel-service-name"
        if span_groups is not None:
            out.span_groups = span_groups
            out.sources["span_groups"] = "--otel-span-groups"
        return out

    def _source(self, field: str) -> str:
        return self.sources.get(field, field)

    def resolved_span_groups(self) -> FrozenSet[str]:
        """The enabled group names from ``span_groups``; ``ValueError`` naming the source if unknown."""
        return self.span_group_cls.resolve(self.span_groups, source=self._source("span_groups"))

    def validate(self) -> "TelemetryConfig":
        """Check every value, also when telemetry is disabled, so that every rank fails alike.

        Raises ``ValueError`` naming the variable/flag and listing the valid choices for a sample
        rate outside [0, 1], an unknown rank strategy, sampling strategy, exporter or span group,
        an empty service name, or (enabled, ``otlp``) an unsupported ``OTEL_EXPORTER_OTLP_*PROTOCOL``
        or a malformed ``OTEL_EXPORTER_OTLP_*HEADERS`` (named, its value never shown).
        Returns ``self``.
        """
        from .sampling import registered_sampling_strategies
        from .strategies import registered_rank_strategies

        if not 0.0 <= float(self.export_sample_rate) <= 1.0:
            raise ValueError(
                f"{self._source('export_sample_rate')}={self.export_sample_rate!r} is outside [0, 1]"
            )
        strategies = registered_rank_strategies()
        if str(self.rank_strategy).strip().lower() not in strategies:
            raise ValueError(
                f"{self._source('rank_strategy')}={self.rank_strategy!r} is not a rank strategy; "
                f"valid choices: {', '.join(strategies)}"
            )
        samplers = registered_sampling_strategies()
        if self.sampling_strategy and self.sampling_strategy.strip().lower() not in samplers:
            raise ValueError(
                f"{self._source('sampling_strategy')}={self.sampling_strategy!r} is not a sampling strategy; "
                f"valid choices: (empty), {', '.join(samplers)}"
            )
        if str(self.exporter).strip().lower() not in EXPORTERS:
            raise ValueError(
                f"{self._source('exporter')}={self.exporter!r} is not an exporter; valid choices: {', '.join(EXPORTERS)}"
            )
        if str(self.metrics_exporter).strip().lower() not in METRICS_EXPORTERS:
            raise ValueError(
                f"{self._source('metrics_exporter')}={self.metrics_exporter!r} is not a metrics exporter; "
                f"valid choices: (empty: as {self._source('exporter')}), {', '.join(METRICS_EXPORTERS[1:])}"
            )
        if not 0 <= int(self.prometheus_port) <= 65535:
            raise ValueError(f"{self._source('prometheus_port')}={self.prometheus_port!r} is not a TCP port (0-65535)")
        if not isinstance(self.service_name, str) or not self.service_name.strip():
            raise ValueError(f"{self._source('service_name')}: service name must be a non-empty string")
        self.resolved_span_groups()
        if self.enabled and "otlp" in (str(self.exporter).strip().lower(), str(self.metrics_exporter).strip().lower()):
            for signal in ("traces", "metrics", "logs"):
                otlp_protocol(signal)
            check_otlp_headers()
        return self
