"""``setup_telemetry``: decide whether this rank exports, build its providers, return a ``TelemetryHandle``."""
from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Mapping, Optional

from . import state as _state
from .fallbacks import NOOP_METER, NOOP_TRACER
from .resources import compute_job_uuids, detect_resource_attributes, resolve_run_identity, service_instance_id
from .strategies import lowest_exporting_rank, node_local_rank, should_export

__all__ = ["TelemetryHandle", "setup_telemetry", "get_active_handle", "TRACER_NAME", "AT_EXIT_TIMEOUT_MS"]

logger = logging.getLogger(__name__)
TRACER_NAME = "megatron"
# The shutdown budget at the end of training and at interpreter exit: a live collector takes the last
# batch in milliseconds; a dead one must not hold the job's exit (it added ~5 s with 5000 here).
AT_EXIT_TIMEOUT_MS = 2000
_SETUP_LOCK = threading.Lock()
_ATEXIT_REGISTERED = False


def _sdk_disabled() -> bool:
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


class TelemetryHandle:
    """What ``setup_telemetry`` returns: the tracer and meter to use, whether this rank exports,
    the run id, and a bounded, idempotent ``shutdown``.

    On disabled or non-exporting ranks ``tracer``/``meter`` are shared no-op objects and no SDK
    object exists.
    """

    def __init__(self, config, rank: int, world_size: int, is_exporting: bool, run_id: Optional[str],
                 tracer=NOOP_TRACER, meter=NOOP_METER, providers=None, enabled_span_groups=frozenset(),
                 resource_attributes: Optional[Mapping[str, object]] = None, launch_uuid: Optional[str] = None):
        self.config = config
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.is_exporting = bool(is_exporting)
        self.run_id = run_id
        # New for every launch/restart and shared by all ranks: the per-iteration trace ids derive from it.
        self.launch_uuid = launch_uuid
        # The one rank that emits each iteration's root span (megatron.iteration); see
        # distributed.iteration_step_span. Set on exporting ranks by setup_telemetry.
        self.iteration_root_rank: Optional[int] = None
        self.tracer = tracer
        self.meter = meter
        self.enabled_span_groups = frozenset(enabled_span_groups)
        self.resource_attributes = dict(resource_attributes or {})
        self._providers = providers
        self._pid = os.getpid()
        self._shutdown_done = False
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether telemetry was enabled by configuration (on every rank, exporting or not)."""
        return bool(self.config is not None and self.config.enabled)

    @property
    def logger_provider(self):
        """The SDK LoggerProvider when logs are on and this rank exports, else ``None``."""
        return None if self._providers is None else self._providers.logger_provider

    @property
    def tracer_provider(self):
        """The SDK TracerProvider when traces are on and this rank exports, else ``None``."""
        return None if self._providers is None else self._providers.tracer_provider

    @property
    def meter_provider(self):
        """The SDK MeterProvider when metrics are on and this rank exports, else ``None``."""
        return None if self._providers is None else self._providers.meter_provider

    @property
    def is_shutdown(self) -> bool:
        """Whether ``shutdown`` has run."""
        return self._shutdown_done

    def force_flush(self, timeout_ms: int = 5000) -> bool:
        """Export buffered spans, metrics and logs, waiting at most ``timeout_ms``; returns success."""
        if self._providers is None or self._shutdown_done or os.getpid() != self._pid:
            return True
        from .providers import force_flush_providers

        return force_flush_providers(self._providers, timeout_ms)

    def snapshot_metrics(self) -> None:
        """Queue the current metric values for export now (the training loop calls it after each
        ``--log-interval`` record, so no logged gauge value is overwritten unexported). Cheap, never
        waits on the collector; a no-op on non-exporting ranks, after shutdown, in forked children and
        with a caller-supplied reader that has no ``snapshot`` (tests collect those themselves)."""
        if self._providers is None or self._shutdown_done or os.getpid() != self._pid:
            return
        snapshot = getattr(self._providers.metric_reader, "snapshot", None)
        if snapshot is not None:
            snapshot()

    def shutdown(self, timeout_ms: int = 5000) -> None:
        """End open spans (marked ``nemo.span.truncated=true``), flush, and stop exporting.

        Returns within ``timeout_ms`` (plus scheduling noise) even against an unreachable
        collector; never raises; later calls do nothing. In a forked child it only detaches the
        inherited handle (the parent owns the providers).
        """
        with self._lock:
            if self._shutdown_done:
                return
            self._shutdown_done = True
        from .logging_bridge import teardown_logging_bridge

        teardown_logging_bridge(self)
        _state.deactivate(self)
        if self._providers is None or os.getpid() != self._pid:
            return
        from .global_providers import uninstall_providers

        uninstall_providers(self._providers.tracer_provider, self._providers.meter_provider,
                            self._providers.logger_provider)
        from .providers import shutdown_providers

        try:
            if not shutdown_providers(self._providers, timeout_ms):
                logger.warning("telemetry shutdown did not finish within %d ms; unsent data was dropped", timeout_ms)
        except Exception:
            logger.warning("telemetry shutdown failed", exc_info=True)

    def __repr__(self) -> str:
        return (f"TelemetryHandle(rank={self.rank}, world_size={self.world_size}, enabled={self.enabled}, "
                f"is_exporting={self.is_exporting}, run_id={self.run_id!r})")


def get_active_handle() -> Optional[TelemetryHandle]:
    """The live handle set up by this process, or ``None``."""
    return _state.live_handle()


def _shutdown_at_exit() -> None:
    handle = _state.live_handle()
    if handle is not None:
        handle.shutdown(timeout_ms=AT_EXIT_TIMEOUT_MS)


def setup_telemetry(
    config,
    rank: int,
    world_size: int,
    resource_attributes: Optional[Mapping[str, object]] = None,
    span_exporter=None,
    metric_reader=None,
    export_strategy=None,
    *,
    log_exporter=None,
    out=None,
) -> TelemetryHandle:
    """Set up telemetry for this process (spec sections 1, 2, 5 and 8).

    ``config`` is validated first on every rank (``ValueError`` names the bad setting). When it is
    disabled a no-op handle is returned. Otherwise the run id and the launch uuid are resolved
    (identical on all ranks; one broadcast when ``torch.distributed`` is initialised with more than
    one rank, so call this on every rank, after ``init_process_group`` for ids unique per launch), ``export_strategy`` (a registered name or a callable
    ``fn(config, rank, world_size)``; default ``config.rank_strategy``) decides whether this rank
    exports, and only an exporting rank detects resources and builds SDK providers.
    ``span_exporter``/``metric_reader``/``log_exporter`` replace the configured sinks (tests);
    ``out`` is the console exporter's stream (default stdout). ``OTEL_SDK_DISABLED=true`` makes
    every rank non-exporting.

    Raises ``RuntimeError`` when an enabled handle of this process is still live (call its
    ``shutdown`` first) and ``ImportError`` when an exporting rank cannot import OpenTelemetry.
    """
    global _ATEXIT_REGISTERED
    if config is None:
        raise ValueError("setup_telemetry: config is None; build one with TelemetryConfig.from_env()")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"setup_telemetry: rank={rank} is not in [0, world_size={world_size})")
    config.validate()
    if not config.enabled:
        return TelemetryHandle(config, rank, world_size, is_exporting=False, run_id=None)
    with _SETUP_LOCK:
        live = _state.live_handle()
        if live is not None and not live.is_shutdown:
            raise RuntimeError(
                "setup_telemetry() has already been initialised for this process and its handle is live; "
                "call handle.shutdown() before setting telemetry up again"
            )
        groups = config.resolved_span_groups()
        run_id, launch_uuid = resolve_run_identity(config.run_id, world_size)
        exporting = should_export(config, rank, world_size, export_strategy) and not _sdk_disabled()
        if not exporting:
            handle = TelemetryHandle(config, rank, world_size, is_exporting=False, run_id=run_id,
                                     launch_uuid=launch_uuid)
            _state.activate(frozenset(), NOOP_TRACER, NOOP_METER, handle)
            return handle

        from .providers import build_providers  # the SDK is imported only here, on exporting ranks
        from .resources.local import package_version
        from .sampling import build_sampler

        job_uuid, run_uuid = compute_job_uuids()
        attrs = detect_resource_attributes(local_rank=node_local_rank())
        attrs.update({
            "service.name": config.service_name,
            "service.version": package_version(),
            "service.instance.id": service_instance_id(run_id, rank),
            "nemo.run.id": run_id,
            "nemo.lens.job_uuid": job_uuid,
            "nemo.lens.run_uuid": run_uuid,
            "megatron.launch.uuid": launch_uuid,
            "dl.rank": int(rank),
            "dl.world_size": int(world_size),
        })
        if config.user_id:
            attrs["nemo.user.id"] = config.user_id
        attrs.update(resource_attributes or {})
        providers = build_providers(
            config, attrs, span_exporter=span_exporter, metric_reader=metric_reader,
            log_exporter=log_exporter, sampler=build_sampler(config, rank, world_size), out=out,
        )
        from .global_providers import install_providers

        # Spans, metrics and logs of trace.get_tracer / metrics.get_meter / _logs.get_logger in user code
        # and libraries reach our exporters too (a signal whose global provider the application set
        # itself keeps it).
        install_providers(providers.tracer_provider, providers.meter_provider, providers.logger_provider)
        tracer = NOOP_TRACER
        if providers.tracer_provider is not None:
            tracer = providers.tracer_provider.get_tracer(TRACER_NAME, package_version())
        meter = (providers.meter_provider.get_meter(TRACER_NAME, package_version())
                 if providers.meter_provider is not None else NOOP_METER)
        enabled_groups = groups if providers.tracer_provider is not None else frozenset()
        handle = TelemetryHandle(config, rank, world_size, is_exporting=True, run_id=run_id, tracer=tracer,
                                 meter=meter, providers=providers, enabled_span_groups=enabled_groups,
                                 resource_attributes=attrs, launch_uuid=launch_uuid)
        try:
            handle.iteration_root_rank = lowest_exporting_rank(config, world_size, export_strategy)
        except Exception:  # a custom strategy that cannot answer for other ranks: no derived root
            logger.warning("telemetry: cannot tell which rank emits the per-iteration root span", exc_info=True)
        _state.activate(enabled_groups, tracer, meter, handle)
        if not _ATEXIT_REGISTERED:
            atexit.register(_shutdown_at_exit)
            _ATEXIT_REGISTERED = True
        return handle
