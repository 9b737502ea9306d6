"""The OTLP exporter's environment: transport protocol and header-list checks, read before the SDK sees them."""
from __future__ import annotations

import os
import re
from typing import Mapping, Optional, Tuple
from urllib.parse import urlsplit

__all__ = ["OTLP_PROTOCOLS", "OTLP_HEADER_VARIABLES", "OTLP_ENDPOINT_VARIABLES", "otlp_protocol",
           "otlp_headers_problem", "check_otlp_headers", "otlp_endpoint_problem", "check_otlp_endpoints"]

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


OTLP_ENDPOINT_VARIABLES: Tuple[str, ...] = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                                            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT")
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)$")


def otlp_endpoint_problem(value: str, protocol: str = "grpc") -> Optional[str]:
    """What is wrong with an OTLP endpoint URL, or ``None`` when the exporter can use it.

    A URL needs the scheme ``http`` or ``https``, a host, and a port (if any) in 1-65535, and no
    blank inside. Over gRPC the Python SDK also takes a bare ``host:port`` (it dials the channel
    target as given), so that is accepted there; the HTTP exporter needs the full URL.
    """
    text = value.strip()
    if any(c.isspace() for c in text):
        return "it holds a blank"
    if "://" not in text:
        if protocol == "grpc" and _HOST.match(text.rsplit(":", 1)[0] if ":" in text else text):
            port = text.rsplit(":", 1)[1] if ":" in text and not text.endswith("]") else None
            if port is None or (port.isdigit() and 1 <= int(port) <= 65535):
                return None
            return f"the port {port!r} is not a number in 1-65535"
        return "it has no scheme (expected http:// or https://)"
    parts = urlsplit(text)
    if parts.scheme.lower() not in ("http", "https"):
        return f"the scheme {parts.scheme!r} is not http or https"
    host = parts.hostname
    if not host or not _HOST.match(f"[{host}]" if ":" in host else host):
        return "it names no host"
    try:
        port = parts.port  # ValueError for a non-number or one out of range
    except ValueError:
        return f"the port {parts.netloc.rsplit(':', 1)[-1]!r} is not a number in 1-65535"
    if port == 0:
        return "the port 0 is not in 1-65535"
    return None


def check_otlp_endpoints(environ: Optional[Mapping[str, str]] = None) -> None:
    """Check every set ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``_TRACES_`` / ``_METRICS_`` / ``_LOGS_ENDPOINT``
    against the protocol its signal uses (``otlp_protocol``).

    Raises ``ValueError`` naming the variable, the value (user and password, if any, hidden) and what
    is wrong, so that a typo stops the run at start-up instead of every export failing.
    """
    env = os.environ if environ is None else environ
    for name in OTLP_ENDPOINT_VARIABLES:
        value = env.get(name) or ""
        if not value.strip():
            continue
        signal = name[len("OTEL_EXPORTER_OTLP_"):-len("_ENDPOINT")].lower() or "traces"
        signals = ("traces", "metrics", "logs") if name == "OTEL_EXPORTER_OTLP_ENDPOINT" else (signal,)
        for sig in signals:
            problem = otlp_endpoint_problem(value, otlp_protocol(sig, env))
            if problem is not None:
                shown = re.sub(r"//[^/@]*@", "//***@", value.strip())
                raise ValueError(f"{name}={shown!r} is not a valid OTLP endpoint: {problem}; "
                                 "write e.g. http://collector:4317 (grpc) or http://collector:4318 (http/protobuf)")
