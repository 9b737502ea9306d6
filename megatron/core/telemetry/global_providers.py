"""The OpenTelemetry global tracer, meter and logger providers: the helpers' default tracer, and the
switchable providers ``setup_telemetry`` installs so that ``trace.get_tracer(...)``,
``metrics.get_meter(...)`` and ``_logs.get_logger(...)`` in user code reach our exporters.

Imports only the OpenTelemetry API (never the SDK), and only when first used.
"""
from __future__ import annotations

import os
import threading
import weakref

__all__ = ["default_tracer", "context_and_trace_api", "install_providers", "uninstall_providers",
           "INSTRUMENTATION_SCOPE"]

INSTRUMENTATION_SCOPE = "megatron"
_LOCK = threading.Lock()
# signal -> the one switching provider of this process that is (or was) the global one
_INSTALLED: dict = {}


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


_API = None


def context_and_trace_api():
    """``(opentelemetry.context, opentelemetry.trace)``, or ``False`` when OpenTelemetry is not installed;
    imported once."""
    global _API
    if _API is None:
        try:
            from opentelemetry import context, trace
        except ImportError:
            _API = False
        else:
            _API = (context, trace)
    return _API


class _Live:
    """The SDK provider a switching provider serves now: ``None`` when none is live and in a forked
    child (the parent owns the providers)."""

    def __init__(self) -> None:
        self.provider, self.pid = None, os.getpid()

    def get(self):
        return self.provider if os.getpid() == self.pid else None

    def set(self, provider) -> None:
        self.provider, self.pid = provider, os.getpid()


class _Resolved:
    """What a switching tracer or logger hands out: the live provider's object for ``args``,
    fetched again only when the live provider changes."""

    def __init__(self, live: _Live, getter: str, args, noop) -> None:
        self._live, self._getter, self._args, self._noop = live, getter, args, noop
        self._for, self._real = None, None

    def resolve(self):
        provider = self._live.get()
        if provider is None:
            return self._noop
        if self._for is not provider:
            self._real, self._for = getattr(provider, self._getter)(*self._args), provider
        return self._real


def _tracer_provider_class():
    from opentelemetry import trace

    class SwitchingTracer(trace.Tracer):
        """A tracer handed out once (user code keeps it, e.g. at module level) that starts its spans
        on whichever SDK provider is live now (a no-op when none is)."""

        def __init__(self, live, args):
            self._target = _Resolved(live, "get_tracer", args, trace.NoOpTracer())

        def start_span(self, *args, **kwargs):
            return self._target.resolve().start_span(*args, **kwargs)

        def start_as_current_span(self, *args, **kwargs):
            return self._target.resolve().start_as_current_span(*args, **kwargs)

    class SwitchingTracerProvider(trace.TracerProvider):
        def __init__(self):
            self.live = _Live()

        def get_tracer(self, instrumenting_module_name, instrumenting_library_version=None, schema_url=None,
                       attributes=None):
            return SwitchingTracer(self.live, (instrumenting_module_name, instrumenting_library_version, schema_url,
                                               attributes))

    return SwitchingTracerProvider


def _logger_provider_class():
    from opentelemetry import _logs

    class SwitchingLogger(_logs.Logger):
        """A logger that emits on whichever SDK logger provider is live now (a no-op when none is)."""

        def __init__(self, live, args):
            super().__init__(*args)
            self._target = _Resolved(live, "get_logger", args, _logs.NoOpLogger(args[0]))

        def emit(self, *args, **kwargs):
            return self._target.resolve().emit(*args, **kwargs)

        def enabled(self, *args, **kwargs):
            return self._target.resolve().enabled(*args, **kwargs)

    class SwitchingLoggerProvider(_logs.LoggerProvider):
        def __init__(self):
            self.live = _Live()

        def get_logger(self, name, version=None, schema_url=None, attributes=None):
            return SwitchingLogger(self.live, (name, version, schema_url, attributes))

    return SwitchingLoggerProvider


class _SwitchingInstrument:
    """An instrument of a switching meter: measurements go to the same-named instrument of the live
    SDK meter provider (created when that provider goes live, so observable callbacks are registered
    on it), and are dropped while none is live."""

    __slots__ = ("_meter_args", "_create", "_args", "_kwargs", "_real", "__weakref__")

    def __init__(self, meter_args, create: str, args, kwargs) -> None:
        self._meter_args, self._create, self._args, self._kwargs = meter_args, create, args, kwargs
        self._real = None

    @property
    def observable(self) -> bool:
        return self._create.startswith("create_observable")

    def bind(self, provider) -> None:
        self._real = None if provider is None else getattr(provider.get_meter(*self._meter_args),
                                                           self._create)(*self._args, **self._kwargs)

    def add(self, *args, **kwargs) -> None:
        if self._real is not None:
            self._real.add(*args, **kwargs)

    def record(self, *args, **kwargs) -> None:
        if self._real is not None:
            self._real.record(*args, **kwargs)

    def set(self, *args, **kwargs) -> None:
        if self._real is not None:
            self._real.set(*args, **kwargs)


def _meter_provider_class():
    from opentelemetry import metrics

    class SwitchingMeter(metrics.Meter):
        """A meter whose instruments follow the live SDK meter provider (see ``_SwitchingInstrument``)."""

        def __init__(self, owner, args):
            super().__init__(*args[:3])
            self._owner, self._args = owner, args

        def _instrument(self, create, *args, **kwargs):
            return self._owner.register(_SwitchingInstrument(self._args, create, args, kwargs))

        def create_counter(self, *args, **kwargs):
            return self._instrument("create_counter", *args, **kwargs)

        def create_up_down_counter(self, *args, **kwargs):
            return self._instrument("create_up_down_counter", *args, **kwargs)

        def create_histogram(self, *args, **kwargs):
            return self._instrument("create_histogram", *args, **kwargs)

        def create_gauge(self, *args, **kwargs):
            return self._instrument("create_gauge", *args, **kwargs)

        def create_observable_counter(self, *args, **kwargs):
            return self._instrument("create_observable_counter", *args, **kwargs)

        def create_observable_up_down_counter(self, *args, **kwargs):
            return self._instrument("create_observable_up_down_counter", *args, **kwargs)

        def create_observable_gauge(self, *args, **kwargs):
            return self._instrument("create_observable_gauge", *args, **kwargs)

    class SwitchingMeterProvider(metrics.MeterProvider):
        def __init__(self):
            self.live = _Live()
            # Synchronous instruments live as long as user code holds them; observable ones as long as
            # this provider (as in the SDK: their callbacks run without anyone holding the instrument).
            self._instruments = weakref.WeakSet()
            self._observables = []
            self._lock = threading.Lock()

        def get_meter(self, name, version=None, schema_url=None, attributes=None):
            return SwitchingMeter(self, (name, version, schema_url, attributes))

        def register(self, instrument):
            with self._lock:
                instrument.bind(self.live.get())
                self._instruments.add(instrument)
                if instrument.observable:
                    self._observables.append(instrument)
            return instrument

        def switch(self, provider) -> None:
            with self._lock:
                self.live.set(provider)
                for instrument in list(self._instruments):
                    instrument.bind(provider)

    return SwitchingMeterProvider


def _signals():
    """signal -> (get the global provider, set it, the API's placeholder class, our switching class)."""
    from opentelemetry import _logs, metrics, trace
    from opentelemetry._logs._internal import ProxyLoggerProvider
    from opentelemetry.metrics._internal import _ProxyMeterProvider

    return {
        "traces": (trace.get_tracer_provider, trace.set_tracer_provider, trace.ProxyTracerProvider,
                   _tracer_provider_class),
        "metrics": (metrics.get_meter_provider, metrics.set_meter_provider, _ProxyMeterProvider,
                    _meter_provider_class),
        "logs": (_logs.get_logger_provider, _logs.set_logger_provider, ProxyLoggerProvider, _logger_provider_class),
    }


def _switch(switching, provider) -> None:
    if hasattr(switching, "switch"):
        switching.switch(provider)
    else:
        switching.live.set(provider)


def install_providers(tracer_provider=None, meter_provider=None, logger_provider=None) -> dict:
    """Make the given SDK providers what OpenTelemetry's global ``get_tracer``/``get_meter``/
    ``get_logger`` serve in this process (``None``: leave that signal alone).

    The API lets a process set each global provider once, so the first call installs a switching
    provider per signal and later calls (after a shutdown and a new ``setup_telemetry``) swap what it
    serves; tracers, meters, instruments and loggers handed out earlier follow. A signal whose global
    provider the application set itself is left alone: its data stays with its provider and ours with
    ours. Returns ``{signal: installed?}`` for the signals given.
    """
    given = {"traces": tracer_provider, "metrics": meter_provider, "logs": logger_provider}
    result = {}
    with _LOCK:
        for signal, (get, set_, placeholder, make) in _signals().items():
            provider = given[signal]
            if provider is None:
                continue
            current = get()
            switching = _INSTALLED.get(signal)
            if switching is not None and current is switching:
                _switch(switching, provider)
                result[signal] = True
                continue
            if not isinstance(current, placeholder):
                result[signal] = False  # the application's own provider
                continue
            switching = make()()
            _switch(switching, provider)
            set_(switching)
            result[signal] = get() is switching  # False: lost a race with the application
            if result[signal]:
                _INSTALLED[signal] = switching
    return result


def uninstall_providers(*sdk_providers) -> None:
    """Stop serving each of ``sdk_providers`` globally (its signal's global objects become no-ops) if
    it is the one served."""
    with _LOCK:
        for switching in _INSTALLED.values():
            if switching.live.get() is not None and switching.live.get() in sdk_providers:
                _switch(switching, None)
