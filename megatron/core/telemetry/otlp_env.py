"""The OTLP exporter's environment: transport protocol and header-list checks, read before the SDK sees them."""
from __future__ import annotations

import os
import re
from typing import Mapping, Optional, Tuple

__all__ = ["OTLP_PROTOCOLS", "OTLP_HEADER_VARIABLES", "otlp_protocol", "otlp_headers_problem", "check_otlp_headers"]

OTLP_PROTOCOLS: Tuple[str, ...] = ("grpc", "http/protobuf")


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
