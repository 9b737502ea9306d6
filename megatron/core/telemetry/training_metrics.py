"""Training metric instruments (spec section 6 and the progress / step-breakdown set) and ``record_training_metrics``."""
from __future__ import annotations

import logging
import math
import weakref
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

__all__ = ["record_training_metrics", "TRAINING_INSTRUMENTS", "PROGRESS_INSTRUMENTS", "MOE_INSTRUMENTS",
           "get_instruments", "initialize_counters", "observe_heartbeat"]

logger = logging.getLogger(__name__)

# keyword -> (instrument name, kind, unit, description)
TRAINING_INSTRUMENTS: Dict[str, Tuple[str, str, str, str]] = {
    "step_duration_ms": ("megatron.training.step_duration_ms", "histogram", "ms", "Wall time of one training iteration"),
    "loss": ("megatron.training.loss", "gauge", "1", "Training language-model loss"),
    "throughput_tflops": ("megatron.training.throughput_tflops", "gauge", "TFLOP/s", "Model TFLOP/s per GPU"),
    "tokens_per_sec": ("megatron.training.tokens_per_sec", "gauge", "tokens/s", "Tokens processed per second"),
    "grad_norm": ("megatron.training.grad_norm", "gauge", "1", "Global gradient L2 norm"),
    "skipped_iters": ("megatron.training.skipped_iters", "counter", "iterations",
                      "Iterations skipped for NaN/inf gradients or loss-scale overflow"),
    "learning_rate": ("megatron.training.learning_rate", "gauge", "1", "Learning rate"),
    "memory_allocated_gb": ("megatron.training.memory_allocated_gb", "gauge", "GB", "Peak allocated device memory"),
    "validation_loss": ("megatron.validation.loss", "gauge", "1", "Validation loss"),
    "validation_ppl": ("megatron.validation.ppl", "gauge", "1", "Validation perplexity"),
}
# Beyond the spec's table: progress and liveness, where each rank's step time goes, the straggler
# view and memory per rank. Gauges, recorded at each --log-interval; per-rank ones carry ``dl.rank`` (and the
# rank's parallel coordinates), the straggler view ``dl.pipeline_parallel.rank``.
_STEP_PARTS = ("forward_compute", "backward_compute", "data_wait", "tp_comm", "pp_comm", "cp_comm", "ep_comm", "grad_sync",
               "optimizer", "other", "total")
PROGRESS_INSTRUMENTS: Dict[str, Tuple[str, str, str, str]] = {
    "iteration": ("megatron.training.iteration", "gauge", "1", "Iterations completed"),
    "consumed_samples": ("megatron.training.consumed_samples", "gauge", "samples", "Training samples consumed"),
    "consumed_tokens": ("megatron.training.consumed_tokens", "gauge", "tokens", "Training tokens consumed"),
    **{f"step_{part}_ms": (f"megatron.training.step.{part}_ms", "gauge", "ms",
                           f"Per-iteration {part.replace('_', ' ')} time of this rank (exclusive)")
       for part in _STEP_PARTS},
    "straggler_slowest_compute_ms": ("megatron.training.straggler.slowest_compute_ms", "gauge", "ms",
                                     "Slowest rank's forward+backward compute time per iteration, within a pipeline stage"),
    "straggler_fastest_compute_ms": ("megatron.training.straggler.fastest_compute_ms", "gauge", "ms",
                                     "Fastest rank's forward+backward compute time per iteration, within a pipeline stage"),
    "straggler_gap_ms": ("megatron.training.straggler.gap_ms", "gauge", "ms",
                         "Slowest minus fastest rank's compute time per iteration, within a pipeline stage"),
    "straggler_ratio": ("megatron.training.straggler.ratio", "gauge", "1",
                        "Slowest over fastest compute time, within a pipeline stage (absent below 50 ms of compute)"),
    "straggler_slowest_rank": ("megatron.training.straggler.slowest_rank", "gauge", "1", "Rank of the slowest within a pipeline stage"),
    "straggler_fastest_rank": ("megatron.training.straggler.fastest_rank", "gauge", "1", "Rank of the fastest within a pipeline stage"),
    "rank_memory_allocated_gb": ("megatron.training.memory.allocated_gb", "gauge", "GB", "Allocated device memory"),
    "rank_memory_reserved_gb": ("megatron.training.memory.reserved_gb", "gauge", "GB", "Reserved device memory"),
    "rank_memory_peak_gb": ("megatron.training.memory.peak_gb", "gauge", "GB", "Peak allocated device memory"),
    "rank_memory_rss_gb": ("megatron.training.memory.rss_gb", "gauge", "GB", "Resident host memory"),
    # Troubleshooting (megatron/training/troubleshooting.py): reports printed, as counters.
    "hang_reports": ("megatron.training.hang_reports", "counter", "reports",
                     "Hang reports printed (a rank's heartbeat stopped for --hang-report-seconds)"),
    "slow_steps": ("megatron.training.slow_steps", "counter", "steps",
                   "Steps slower than --slow-step-factor times the running median"),
}
# Mixture of experts, per MoE layer (attribute ``megatron.moe.layer``, the 1-based global layer number) and, for
# the token counts, per expert (``megatron.moe.expert``, the global expert index). Counts cover the log interval
# (every iteration and micro-batch since the previous log line) and the whole model: summed over the ranks
# that route distinct tokens of the layer (megatron/training/moe_metrics.py).
MOE_INSTRUMENTS: Dict[str, Tuple[str, str, str, str]] = {
    "moe_tokens_per_expert": ("megatron.training.moe.tokens_per_expert", "gauge", "tokens",
                              "Tokens the router sent to the expert over the log interval, all ranks (a token "
                              "counts once per chosen expert; before capacity dropping)"),
    "moe_imbalance": ("megatron.training.moe.imbalance", "gauge", "1",
                      "Most loaded expert's tokens over the mean per expert, over the log interval (1 = balanced)"),
    "moe_dropped_tokens": ("megatron.training.moe.dropped_tokens", "gauge", "tokens",
                           "Token-to-expert assignments dropped by the capacity factor over the log interval, "
                           "all ranks (0 when dropless)"),
}
_ALL_INSTRUMENTS = {**TRAINING_INSTRUMENTS, **PROGRESS_INSTRUMENTS, **MOE_INSTRUMENTS}
HEARTBEAT_INSTRUMENT = ("megatron.training.last_step_timestamp", "s", "Unix time at which the last iteration finished")

# Step times span milliseconds (tiny models) to minutes (large ones); the SDK default tops out at 10 s.
STEP_DURATION_BOUNDARIES_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                               100000, 200000, 500000)

_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_REPORTED_FAILURES: set = set()  # (meter type, instrument key, exception type) already logged


def _create(meter, key: str):
    name, kind, unit, description = _ALL_INSTRUMENTS[key]
    if kind == "histogram":
        try:
            return meter.create_histogram(name, unit=unit, description=description,
                                          explicit_bucket_boundaries_advisory=list(STEP_DURATION_BOUNDARIES_MS))
        except TypeError:  # meters without advisory support (no-op fallbacks, older APIs)
            return meter.create_histogram(name, unit=unit, description=description)
    if kind == "counter":
        return meter.create_counter(name, unit=unit, description=description)
    return meter.create_gauge(name, unit=unit, description=description)


class _Instruments(dict):
    """``{keyword: instrument}`` of one meter, each created on first use."""

    def __init__(self, meter, weak: bool = True):
        super().__init__()
        self._meter = weakref.ref(meter) if weak else (lambda: meter)

    def __missing__(self, key):
        meter = self._meter()
        if meter is None:
            raise KeyError(key)
        instrument = _create(meter, key)
        self[key] = instrument
        return instrument


def get_instruments(meter) -> Dict[str, Any]:
    """The instruments of ``meter`` (a mapping keyword -> instrument, each created on first use),
    cached per meter (weakly, so a shut down meter is freed); the same object on every call.
    Raises ``TypeError`` if ``meter`` cannot be weakly referenced."""
    instruments = _CACHE.get(meter)
    if instruments is None:
        instruments = _Instruments(meter)
        _CACHE[meter] = instruments
    return instruments


def _as_float(key: str, value: Any) -> float:
    if callable(getattr(value, "item", None)):
        value = value.item()  # 0-d tensor or numpy scalar
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"record_training_metrics: {key}={value!r} is not a number") from None


def _report_failure(meter, key: str, error: Exception) -> None:
    """Log a failing meter once per (meter type, metric, error type): training goes on without it."""
    signature = (type(meter).__name__, key, type(error).__name__)
    if signature in _REPORTED_FAILURES:
        return
    _REPORTED_FAILURES.add(signature)
    logger.warning("telemetry: recording %s on %s failed (%s: %s); training continues, further failures of "
                   "this kind are not logged", key, type(meter).__name__, type(error).__name__, error)


def record_training_metrics(meter, *, attributes: Optional[Mapping[str, Any]] = None, **values: Any) -> int:
    """Record the given training values on ``meter``; values that are ``None`` are skipped and a
    ``None`` meter records nothing. Keywords (units): ``step_duration_ms`` (ms, histogram),
    ``loss``, ``throughput_tflops`` (TFLOP/s per GPU), ``tokens_per_sec``, ``grad_norm``,
    ``skipped_iters`` (iterations, counter: pass the increment; 0 records nothing),
    ``learning_rate``, ``memory_allocated_gb`` (GB, peak), ``validation_loss``, ``validation_ppl``,
    and the progress / step-breakdown gauges of ``PROGRESS_INSTRUMENTS`` (``iteration``,
    ``consumed_samples``, ``consumed_tokens``, ``step_<part>_ms``, ``straggler_*``, ``rank_memory_*_gb``)
    and the mixture-of-experts gauges of ``MOE_INSTRUMENTS`` (``moe_tokens_per_expert``, ``moe_imbalance``,
    ``moe_dropped_tokens``, recorded with layer / expert attributes).
    Non-finite gauge values (NaN loss) are recorded as they are: they are the signal.

    ``attributes`` (a non-empty mapping) is passed as ``attributes=`` to every instrument call; without
    attributes the call is the bare ``record(v)`` / ``set(v)`` / ``add(v)``, so meters whose instruments
    take no attributes (nemo-lens-style shims, test doubles) record too. A meter or instrument that raises does not stop training: the error
    is logged once per kind and the value is dropped (as Megatron-LM does).

    Returns how many values were recorded. Raises ``TypeError`` for an unknown keyword (listing the
    valid ones) or a non-numeric value, ``ValueError`` for a negative or non-finite ``skipped_iters``:
    those are bugs of the caller, not of the meter.
    """
    unknown = sorted(set(values) - set(_ALL_INSTRUMENTS))
    if unknown:
        raise TypeError(f"record_training_metrics: unknown metric(s) {unknown}; valid: {', '.join(_ALL_INSTRUMENTS)}")
    if meter is None:
        return 0
    numbers = {}
    for key, value in values.items():
        if value is None:
            continue
        number = _as_float(key, value)
        if _ALL_INSTRUMENTS[key][1] == "counter" and (number < 0 or not math.isfinite(number)):
            raise ValueError(f"record_training_metrics: {key}={value!r} must be a finite count >= 0")
        numbers[key] = number
    try:
        instruments = get_instruments(meter)
    except TypeError:  # a meter that cannot be weakly referenced: instruments are not cached
        instruments = _Instruments(meter, weak=False)
    kwargs = {"attributes": dict(attributes)} if attributes else {}
    recorded = 0
    for key, number in numbers.items():
        kind = _ALL_INSTRUMENTS[key][1]
        if kind == "histogram" and not math.isfinite(number):
            continue  # a histogram bucket cannot hold NaN/inf
        if kind == "counter" and number == 0:
            continue  # nothing happened: no data point (initialize_counters makes the series exist)
        try:
            instrument = instruments[key]
            if kind == "histogram":
                instrument.record(number, **kwargs)
            elif kind == "counter":
                instrument.add(int(number), **kwargs)
            else:
                instrument.set(number, **kwargs)
        except Exception as error:  # a broken meter must never reach the training loop
            _report_failure(meter, key, error)
            continue
        recorded += 1
    return recorded


def initialize_counters(meter, attributes: Optional[Mapping[str, Any]] = None) -> None:
    """Create every counter's series at 0 (one ``add(0)``), so it is present from the first export
    (an alert on ``increase(...)`` needs the 0 before the first increment). Call once per run; later
    zero increments record nothing. Failures are logged once, never raised."""
    if meter is None:
        return
    kwargs = {"attributes": dict(attributes)} if attributes else {}  # as in record_training_metrics
    for key, (_, kind, _, _) in _ALL_INSTRUMENTS.items():
        if kind != "counter":
            continue
        try:
            get_instruments(meter)[key].add(0, **kwargs)
        except Exception as error:
            _report_failure(meter, key, error)


def observe_heartbeat(meter, last_step_time: Callable[[], Optional[float]]) -> Optional[Any]:
    """Register ``megatron.training.last_step_timestamp`` (s, Unix time), an observable gauge read at
    every metric collection (log interval and ``OTEL_METRIC_EXPORT_INTERVAL``), so a stalled job
    shows as a heartbeat that stops advancing even between log lines. ``last_step_time()`` returns
    the time or None (no step yet). Returns the instrument, or None when it cannot be made."""
    if meter is None:
        return None
    name, unit, description = HEARTBEAT_INSTRUMENT

    def callback(options=None):
        value = last_step_time()
        if value is None:
            return []
        from opentelemetry.metrics import Observation

        return [Observation(float(value), {})]

    try:
        return meter.create_observable_gauge(name, callbacks=[callback], unit=unit, description=description)
    except Exception as error:
        _report_failure(meter, "last_step_timestamp", error)
        return None
