"""Telemetry configuration: the ``TelemetryConfig`` dataclass, strict environment parsing, validation."""
from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
from typing import Dict, FrozenSet, Mapping, Optional, Tuple

from .groups import SpanGroup
# The OTLP environment checks and the sampler switch live beside their users (providers, the two
# registries) so that those import nothing from here; re-exported because callers know them here.
from .otlp_env import (
    OTLP_ENDPOINT_VARIABLES,
    OTLP_HEADER_VARIABLES,
    OTLP_PROTOCOLS,
    check_otlp_endpoints,
    check_otlp_headers,
    otlp_headers_problem,
    otlp_protocol,
)
from .sampling import registered_sampling_strategies
from .span_groups import MegatronSpanGroup
from .strategies import effective_sampling_strategy, registered_rank_strategies

__all__ = ["TelemetryConfig", "NemoLensConfig", "effective_sampling_strategy", "parse_bool", "otlp_protocol",
           "otlp_headers_problem", "check_otlp_headers", "check_otlp_endpoints", "warn_unknown_variables",
           "EXPORTERS", "OTLP_PROTOCOLS", "OTLP_HEADER_VARIABLES", "OTLP_ENDPOINT_VARIABLES", "KNOWN_KEYS"]

logger = logging.getLogger(__name__)

EXPORTERS: Tuple[str, ...] = ("otlp", "console")
DEFAULT_STRAGGLER_RATIO_FLOOR_MS = 50.0
# MEGATRON_OTEL_METRICS_EXPORTER: empty = the EXPORTER's; "prometheus" = a pull endpoint on each exporting rank.
METRICS_EXPORTERS: Tuple[str, ...] = ("", "otlp", "console", "prometheus")
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
    raise ValueError(f"Invalid boolean for {name}: {value!r}. Expected '1'/'0', 'true'/'false', 'yes'/'no', 'on'/'off'.")


def _parse_int(value: str, name: str) -> int:
    try:
        return int(str(value).strip(), 10)
    except ValueError:
        raise ValueError(f"Invalid integer for {name}: {value!r}.") from None


def _parse_float(value: str, name: str) -> float:
    try:
        out = float(str(value).strip())
    except ValueError:
        raise ValueError(f"Invalid float for {name}: {value!r}.") from None
    if math.isnan(out):
        raise ValueError(f"Invalid float for {name}: {value!r}.")
    return out


def _sample_rate_message(rate, source: str) -> str:
    """nemo-lens's wording (callers match it), prefixed by the variable or flag when that is not the field."""
    text = f"export_sample_rate must be in [0.0, 1.0], got {rate}"
    return text if source == "export_sample_rate" else f"{source}: {text}"


def _check_sample_rate(rate, source: str) -> None:
    """``ValueError`` naming ``source`` unless ``rate`` is a number in [0, 1]."""
    try:
        ok = 0.0 <= float(rate) <= 1.0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(_sample_rate_message(rate, source))


# field -> (variable keys after the prefix, first one the documented name; parser(value, variable name)).
_ENV_SPECS = (
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
    ("straggler_ratio_floor_ms", ("STRAGGLER_RATIO_FLOOR_MS",), _parse_float),
)
# Every key read after MEGATRON_OTEL_ / NEMO_LENS_ (here and by other modules: EXTRA_KEYS).
KNOWN_KEYS: Tuple[str, ...] = tuple(key for _, keys, _ in _ENV_SPECS for key in keys)
# Keys that other parts of the framework read under the same prefixes; they add theirs here so
# that the misspelling check does not flag them.
EXTRA_KEYS: set = set()
_WARNED_VARIABLES: set = set()


def warn_unknown_variables(prefixes, environ: Optional[Mapping[str, str]] = None) -> None:
    """Log one warning per process for each set ``{prefix}_<KEY>`` whose key nothing reads (a
    misspelling would otherwise be ignored silently, e.g. ``MEGATRON_OTEL_EXPORTR=console`` sends
    OTLP to localhost:4317), with "did you mean" the closest known name (``difflib``)."""
    env = os.environ if environ is None else environ
    known = set(KNOWN_KEYS) | EXTRA_KEYS
    for name in sorted(env):
        for prefix in prefixes:
            head = f"{prefix}_"
            if not name.startswith(head) or name[len(head):] in known or name in _WARNED_VARIABLES:
                continue
            _WARNED_VARIABLES.add(name)
            # Compared without the prefix, which every candidate shares and would make all look close.
            close = difflib.get_close_matches(name[len(head):], sorted(known), n=1, cutoff=0.6)
            hint = (f"; did you mean {head}{close[0]}?" if close
                    else f"; known names: {', '.join(head + key for key in sorted(known))}")
            logger.warning("telemetry: %s is not a known variable and is ignored%s", name, hint)


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
    # Below this compute time (ms per iteration, a stage's fastest rank) no stage straggler ratio is
    # exported (jitter of a few ms on a stage that computes 13 ms read as a 2x straggler); the gap is.
    straggler_ratio_floor_ms: float = DEFAULT_STRAGGLER_RATIO_FLOOR_MS
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
        warn_unknown_variables(prefixes, env)
        for field, keys, parse in _ENV_SPECS:
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
        an empty service name, or (enabled, ``otlp``) an unsupported ``OTEL_EXPORTER_OTLP_*PROTOCOL``,
        a malformed ``OTEL_EXPORTER_OTLP_*HEADERS`` (named, its value never shown) or a malformed
        ``OTEL_EXPORTER_OTLP_*ENDPOINT`` URL.
        Returns ``self``.
        """
        if not 0.0 <= float(self.export_sample_rate) <= 1.0:
            raise ValueError(_sample_rate_message(self.export_sample_rate, self._source("export_sample_rate")))
        strategies = registered_rank_strategies()
        if str(self.rank_strategy).strip().lower() not in strategies:
            raise ValueError(
                f"{self._source('rank_strategy')}: Unknown export_strategy {self.rank_strategy!r}. "
                f"Registered strategies: {', '.join(strategies)}."
            )
        samplers = registered_sampling_strategies()
        if self.sampling_strategy and self.sampling_strategy.strip().lower() not in samplers:
            raise ValueError(
                f"{self._source('sampling_strategy')}={self.sampling_strategy!r} is not a sampling strategy; "
                f"valid choices: (empty), {', '.join(samplers)}"
            )
        if str(self.exporter).strip().lower() not in EXPORTERS:
            raise ValueError(
                f"{self._source('exporter')}: Unknown exporter type: {self.exporter!r}. Expected one of: {', '.join(EXPORTERS)}"
            )
        if str(self.metrics_exporter).strip().lower() not in METRICS_EXPORTERS:
            raise ValueError(
                f"{self._source('metrics_exporter')}={self.metrics_exporter!r} is not a metrics exporter; "
                f"valid choices: (empty: as {self._source('exporter')}), {', '.join(METRICS_EXPORTERS[1:])}"
            )
        if not (isinstance(self.straggler_ratio_floor_ms, (int, float)) and 0 <= self.straggler_ratio_floor_ms < math.inf):
            raise ValueError(f"{self._source('straggler_ratio_floor_ms')}={self.straggler_ratio_floor_ms!r} must be a "
                             "number of milliseconds >= 0")
        if not 0 <= int(self.prometheus_port) <= 65535:
            raise ValueError(f"{self._source('prometheus_port')}={self.prometheus_port!r} is not a TCP port (0-65535)")
        if not isinstance(self.service_name, str) or not self.service_name.strip():
            raise ValueError(f"{self._source('service_name')}: service name must be a non-empty string")
        self.resolved_span_groups()
        if self.enabled and "otlp" in (str(self.exporter).strip().lower(), str(self.metrics_exporter).strip().lower()):
            for signal in ("traces", "metrics", "logs"):
                otlp_protocol(signal)
            check_otlp_headers()
            check_otlp_endpoints()
        return self


class NemoLensConfig(TelemetryConfig):
    """nemo-lens's configuration name: a ``TelemetryConfig`` that also takes nemo-lens's field names.

    ``NemoLensConfig(export_strategy="all_ranks", user="team")`` is ``TelemetryConfig(rank_strategy=
    "all_ranks", user_id="team")``; ``export_strategy`` and ``user`` read and write those fields.
    ``from_env()`` reads ``NEMO_LENS_<KEY>`` with no fallback by default, as nemo-lens does, and takes
    its ``prefix``/``fallback_prefix``/``span_group_cls`` (e.g. ``from_env("MEGATRON_OTEL",
    "NEMO_LENS", MegatronSpanGroup)``); the values are read, checked and named in errors exactly as
    ``TelemetryConfig.from_env`` does. Differences kept on purpose: ``resolved_span_groups`` is a
    method (nemo-lens: a property), the default service name is ``megatron-lm`` (nemo-lens: ``nemo``),
    and a config built directly resolves Megatron's span groups (``span_group_cls``, nemo-lens's
    ``_span_group_cls``, defaults to ``MegatronSpanGroup``; ``from_env`` to the base ``SpanGroup``).
    """

    _ALIASES = {"export_strategy": "rank_strategy", "user": "user_id", "_span_group_cls": "span_group_cls"}

    def __init__(self, **fields) -> None:
        for alias, field in self._ALIASES.items():
            if alias in fields:
                if field in fields:
                    raise TypeError(f"NemoLensConfig: give {alias}= or {field}=, not both")
                value = fields.pop(alias)
                if not (field == "span_group_cls" and value is None):
                    fields[field] = value
        super().__init__(**fields)

    @property
    def export_strategy(self) -> str:
        """nemo-lens's name of ``rank_strategy``."""
        return self.rank_strategy

    @export_strategy.setter
    def export_strategy(self, value: str) -> None:
        self.rank_strategy = value

    @property
    def user(self) -> str:
        """nemo-lens's name of ``user_id``."""
        return self.user_id

    @user.setter
    def user(self, value: str) -> None:
        self.user_id = value

    @classmethod
    def from_env(cls, prefix: str = "NEMO_LENS", fallback_prefix: Optional[str] = None,
                 span_group_cls: Optional[type] = None, environ: Optional[Mapping[str, str]] = None) -> "NemoLensConfig":
        """``TelemetryConfig.from_env`` with nemo-lens's defaults: prefix ``NEMO_LENS``, no fallback,
        the base ``SpanGroup`` class unless one is given. Raises ``ValueError`` naming the variable."""
        return super().from_env(prefix=prefix, fallback_prefix=fallback_prefix,
                                span_group_cls=span_group_cls or SpanGroup, environ=environ)
