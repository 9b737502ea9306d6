"""Bridge Python ``logging`` records to OpenTelemetry logs carrying the current trace and span ids."""
from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Optional

__all__ = ["setup_logging_bridge", "teardown_logging_bridge", "OtelLogHandler"]

_LOCK = threading.Lock()
# logger -> (handler, owner handle or provider)
_INSTALLED: dict = {}
# Python level -> OpenTelemetry SeverityNumber of the same name (logs data model, "Displaying Severity").
_SEVERITY_BASE = ((logging.CRITICAL, 21, "FATAL"), (logging.ERROR, 17, "ERROR"), (logging.WARNING, 13, "WARN"),
                  (logging.INFO, 9, "INFO"), (logging.DEBUG, 5, "DEBUG"))


def _severity(levelno: int):
    from opentelemetry._logs import SeverityNumber

    for base, number, text in _SEVERITY_BASE:
        if levelno >= base:
            # Levels between two named ones map to the finer severities 2..4 above the base.
            return SeverityNumber(min(number + min(levelno - base, 3), 24)), text
    return SeverityNumber.TRACE, "TRACE"


class OtelLogHandler(logging.Handler):
    """``logging.Handler`` that emits each record as an OpenTelemetry log record in the current
    context, so the exported record carries the active trace id and span id. Records from
    ``opentelemetry.*`` loggers are skipped (an exporter error must not feed itself)."""

    def __init__(self, logger_provider, level: int = logging.NOTSET) -> None:
        super().__init__(level=level)
        self.logger_provider = logger_provider

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("opentelemetry"):
            return
        try:
            from opentelemetry._logs import LogRecord
            from opentelemetry.context import get_current

            severity, text = _severity(record.levelno)
            attributes = {
                "code.file.path": record.pathname, "code.function.name": record.funcName,
                "code.line.number": record.lineno, "logger.name": record.name,
            }
            if record.exc_info and record.exc_info[0] is not None:
                attributes["exception.type"] = record.exc_info[0].__name__
                attributes["exception.message"] = str(record.exc_info[1])
                attributes["exception.stacktrace"] = "".join(traceback.format_exception(*record.exc_info))
            otel_logger = self.logger_provider.get_logger(record.name)
            otel_logger.emit(LogRecord(
                timestamp=int(record.created * 1e9), observed_timestamp=time.time_ns(), context=get_current(),
                severity_text=text, severity_number=severity, body=record.getMessage(), attributes=attributes,
            ))
        except Exception:
            self.handleError(record)


def setup_logging_bridge(target, level: int = logging.NOTSET,
                         logger: Optional[logging.Logger] = None) -> Optional[OtelLogHandler]:
    """Attach one ``OtelLogHandler`` to ``logger`` (default: the root logger) for ``target``, a
    ``TelemetryHandle`` or an SDK ``LoggerProvider``.

    Idempotent: calling it again for the same target returns the installed handler; a different
    target replaces it. Returns ``None`` (attaching nothing) when the target has no logger provider
    (logs off or rank not exporting).
    """
    provider = getattr(target, "logger_provider", target)
    if provider is None:
        return None
    logger = logging.getLogger() if logger is None else logger
    with _LOCK:
        installed = _INSTALLED.get(logger)
        if installed is not None:
            handler, owner = installed
            if owner is target:
                return handler
            logger.removeHandler(handler)
        handler = OtelLogHandler(provider, level=level)
        logger.addHandler(handler)
        _INSTALLED[logger] = (handler, target)
        return handler


def teardown_logging_bridge(target=None) -> int:
    """Remove bridge handlers (only those installed for ``target`` when given); returns how many."""
    removed = 0
    with _LOCK:
        for logger, (handler, owner) in list(_INSTALLED.items()):
            if target is None or owner is target:
                logger.removeHandler(handler)
                del _INSTALLED[logger]
                removed += 1
    return removed
