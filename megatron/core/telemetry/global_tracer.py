"""The OpenTelemetry global tracer provider: the helpers' default tracer and the switchable provider
``setup_telemetry`` installs, so that ``trace.get_tracer(...)`` in user code reaches our exporters.

Imports only the OpenTelemetry API (never the SDK), and only when first used.
"""
from __future__ import annotations

import os
import threading

__all__ = ["default_tracer", "install_tracer_provider", "uninstall_tracer_provider", "INSTRUMENTATION_SCOPE"]

INSTRUMENTATION_SCOPE = "megatron"
_LOCK = threading.Lock()
_SWITCHING = None  # the one _SwitchingTracerProvider of this process, once installed


def default_tracer():
    """The tracer helpers use when neither the caller nor a live handle gives one: the global
    provider's ``megatron`` tracer (an application's own provider, ours, or the API's no-op), or the
    framework's no-op tracer when OpenTelemetry is not installed."""
    try:
        from opentelemetry import trace
    except ImportError:
        from .fallbacks import NOOP_TRACER

        return NOOP_TRACER
    return trace.get_tracer(INSTRUMENTATION_SCOPE)


def _switching_class():
    """Build the provider/tracer classes on first use (they subclass API classes)."""
    from opentelemetry import trace

    class SwitchingTracer(trace.Tracer):
        """A tracer handed out once (user code keeps it, e.g. at module level) that starts its spans
        on whichever SDK provider is live now: after a shutdown and a new ``setup_telemetry`` the
        same object reaches the new exporters; with none live (or in a forked child) it is a no-op."""

        def __init__(self, owner, args):
            self._owner, self._args = owner, args
            self._for, self._real = None, None

        def _resolve(self):
            provider = self._owner.delegate()
            if provider is None:
                return _NOOP
            if self._for is not provider:
                self._real, self._for = provider.get_tracer(*self._args), provider
            return self._real

        def start_span(self, *args, **kwargs):
            return self._resolve().start_span(*args, **kwargs)

        def start_as_current_span(self, *args, **kwargs):
            return self._resolve().start_as_current_span(*args, **kwargs)

    class SwitchingTracerProvider(trace.TracerProvider):
        """Global provider whose delegate is the live handle's SDK ``TracerProvider`` (or none)."""

        def __init__(self):
            self._delegate, self._pid = None, os.getpid()

        def delegate(self):
            return self._delegate if os.getpid() == self._pid else None

        def set_delegate(self, provider) -> None:
            self._delegate, self._pid = provider, os.getpid()

        def get_tracer(self, instrumenting_module_name, instrumenting_library_version=None, schema_url=None,
                       attributes=None):
            return SwitchingTracer(self, (instrumenting_module_name, instrumenting_library_version, schema_url,
                                          attributes))

    _NOOP = trace.NoOpTracer()
    return SwitchingTracerProvider


def install_tracer_provider(sdk_provider) -> bool:
    """Make ``sdk_provider`` what ``opentelemetry.trace.get_tracer`` serves in this process.

    The API lets a process set its global provider once, so the first call installs a switching
    provider and later calls (after a shutdown and a new ``setup_telemetry``) swap its delegate.
    Returns ``False``, changing nothing, when the application has set a provider of its own: then
    its spans stay with its provider and ours with ours.
    """
    global _SWITCHING
    from opentelemetry import trace

    with _LOCK:
        current = trace.get_tracer_provider()
        if _SWITCHING is not None and current is _SWITCHING:
            _SWITCHING.set_delegate(sdk_provider)
            return True
        if not isinstance(current, trace.ProxyTracerProvider):
            return False
        switching = _switching_class()()
        switching.set_delegate(sdk_provider)
        trace.set_tracer_provider(switching)
        if trace.get_tracer_provider() is not switching:  # lost a race with the application
            return False
        _SWITCHING = switching
        return True


def uninstall_tracer_provider(sdk_provider) -> None:
    """Stop serving ``sdk_provider`` globally (global tracers become no-ops) if it is the one served."""
    with _LOCK:
        if _SWITCHING is not None and _SWITCHING.delegate() is sdk_provider:
            _SWITCHING.set_delegate(None)
