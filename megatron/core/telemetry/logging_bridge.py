"""Bridge Python ``logging`` records to OpenTelemetry logs carrying the current trace and span ids."""
from __future__ import annotations

import logging
import os
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


# Records of these loggers describe telemetry itself (an export failing, a shutdown running late):
# exporting them could feed the failure that produced them, so they only go to the console.
_OWN_LOGGERS = ("opentelemetry", "megatron.core.telemetry")


def _printed_elsewhere(record: logging.LogRecord) -> bool:
    """Whether a handler other than a bridge will print ``record`` (logging's own walk up the tree)."""
    node = logging.getLogger(record.name)
    while node is not None:
        for handler in node.handlers:
            if not isinstance(handler, OtelLogHandler) and record.levelno >= handler.level:
                return True
        if not node.propagate:
            return False
        node = node.parent
    return False


def _export_suppressed() -> bool:
    """Whether the current context is an SDK export (its processors set this key while exporting)."""
    try:
        from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, get_value
    except ImportError:
        return False
    return bool(get_value(_SUPPRESS_INSTRUMENTATION_KEY))


class OtelLogHandler(logging.Handler):
    """``logging.Handler`` that emits each record as an OpenTelemetry log record in the current
    context, so the exported record carries the active trace id and span id.

    Records about telemetry itself (``opentelemetry.*`` and ``megatron.core.telemetry.*`` loggers,
    or logged while the SDK exports) are never exported, so an exporter error cannot feed itself; and
    when no other handler prints them, they go to stderr exactly as Python prints a warning when no
    handler is configured, so the bridge never hides an exporter's errors. In a forked child
    (data-loader or checkpoint worker) the inherited handler exports nothing.
    """

    def __init__(self, logger_provider, level: int = logging.NOTSET) -> None:
        super().__init__(level=level)
        self.logger_provider = logger_provider
        self._pid = os.getpid()

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(_OWN_LOGGERS) or _export_suppressed():
            if (not getattr(record, "_megatron_bridge_printed", False) and not _printed_elsewhere(record)
                    and logging.lastResort is not None and record.levelno >= logging.lastResort.level):
                record._megatron_bridge_printed = True  # once, even with bridges on several loggers
                logging.lastResort.handle(record)
            return
        if os.getpid() != self._pid:
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


def _default_provider():
    """The live handle's logger provider, else the global one when it is an SDK provider."""
    from . import state as _state

    handle = _state.live_handle()
    if handle is not None and handle.logger_provider is not None:
        return handle, handle.logger_provider
    try:
        from opentelemetry._logs import get_logger_provider
    except ImportError:
        return None, None
    provider = get_logger_provider()
    # The API's no-op and proxy providers cannot export; an SDK provider takes log processors.
    if not hasattr(provider, "add_log_record_processor"):
        return None, None
    return provider, provider


def setup_logging_bridge(target=None, level: Optional[int] = None,
                         logger: Optional[logging.Logger] = None, *,
                         logger_name: Optional[str] = None) -> Optional[OtelLogHandler]:
    """Attach one ``OtelLogHandler`` to a logger. Call shapes:

    * ``setup_logging_bridge()`` (how Megatron's start-up calls it) or
      ``setup_logging_bridge("my.app", logging.INFO)`` (nemo-lens's ``logger_name, level``): bridge
      the named logger (default: the root logger) to the live handle's logger provider, else to the
      global OpenTelemetry one; ``level`` defaults to ``INFO``.
    * ``setup_logging_bridge(handle_or_provider, level=NOTSET, logger=None)``: bridge ``logger``
      (default: root) to a ``TelemetryHandle`` or an SDK ``LoggerProvider``.

    Idempotent per logger: calling it again for the same target returns the installed handler; a
    different target replaces it. Returns ``None`` (attaching nothing) when there is no provider to
    export to (logs off, rank not exporting, telemetry not set up).
    """
    if isinstance(target, str):
        if logger_name is not None:
            raise TypeError("setup_logging_bridge: logger name given twice")
        target, logger_name = None, target
    if target is None:
        owner, provider = _default_provider()
        if level is None:
            level = logging.INFO
    else:
        owner, provider = target, getattr(target, "logger_provider", target)
    if provider is None:
        return None
    if not callable(getattr(provider, "get_logger", None)):
        raise TypeError(f"setup_logging_bridge: {type(target).__name__} is neither a TelemetryHandle, a "
                        "LoggerProvider nor a logger name")
    if logger is None:
        logger = logging.getLogger(logger_name or None)
    level = logging.NOTSET if level is None else level
    with _LOCK:
        installed = _INSTALLED.get(logger)
        if installed is not None:
            handler, previous = installed
            if previous is owner:
                return handler
            logger.removeHandler(handler)
        handler = OtelLogHandler(provider, level=level)
        logger.addHandler(handler)
        _INSTALLED[logger] = (handler, owner)
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
