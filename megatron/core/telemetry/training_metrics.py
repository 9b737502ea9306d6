"""Training metric instruments (spec section 6) and ``record_training_metrics``."""
from __future__ import annotations

import math
import weakref
from typing import Any, Dict, Mapping, Optional, Tuple

__all__ = ["record_training_metrics", "TRAINING_INSTRUMENTS", "get_instruments"]

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
# Step times span milliseconds (tiny models) to minutes (large ones); the SDK default tops out at 10 s.
STEP_DURATION_BOUNDARIES_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                               100000, 200000, 500000)

_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _create(meter, key: str):
    name, kind, unit, description = TRAINING_INSTRUMENTS[key]
    if kind == "histogram":
        try:
            return meter.create_histogram(name, unit=unit, description=description,
                                          explicit_bucket_boundaries_advisory=list(STEP_DURATION_BOUNDARIES_MS))
        except TypeError:  # meters without advisory support (no-op fallbacks, older APIs)
            return meter.create_histogram(name, unit=unit, description=description)
    if kind == "counter":
        return meter.create_counter(name, unit=unit, description=description)
    return meter.create_gauge(name, unit=unit, description=description)


def get_instruments(meter) -> Dict[str, Any]:
    """The instruments of ``meter``, created on first use and cached per meter (weakly, so a shut
    down meter is freed). Raises ``TypeError`` if ``meter`` cannot be weakly referenced."""
    instruments = _CACHE.get(meter)
    if instruments is None:
        instruments = {key: _create(meter, key) for key in TRAINING_INSTRUMENTS}
        _CACHE[meter] = instruments
    return instruments


def _as_float(key: str, value: Any) -> float:
    if callable(getattr(value, "item", None)):
        value = value.item()  # 0-d tensor or numpy scalar
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"record_training_metrics: {key}={value!r} is not a number") from None


def record_training_metrics(meter, *, attributes: Optional[Mapping[str, Any]] = None, **values: Any) -> int:
    """Record the given training values on ``meter``; values that are ``None`` are skipped and a
    ``None`` meter records nothing. Keywords (units): ``step_duration_ms`` (ms, histogram),
    ``loss``, ``throughput_tflops`` (TFLOP/s per GPU), ``tokens_per_sec``, ``grad_norm``,
    ``skipped_iters`` (iterations, counter: pass the increment), ``learning_rate``,
    ``memory_allocated_gb`` (GB, peak), ``validation_loss``, ``validation_ppl``.
    Non-finite gauge values (NaN loss) are recorded as they are: they are the signal.

    Returns how many values were recorded. Raises ``TypeError`` for an unknown keyword (listing the
    valid ones) or a non-numeric value, ``ValueError`` for a negative or non-finite ``skipped_iters``.
    """
    unknown = sorted(set(values) - set(TRAINING_INSTRUMENTS))
    if unknown:
        raise TypeError(f"record_training_metrics: unknown metric(s) {unknown}; valid: {', '.join(TRAINING_INSTRUMENTS)}")
    if meter is None:
        return 0
    instruments = get_instruments(meter)
    attrs = dict(attributes) if attributes else None
    recorded = 0
    for key, value in values.items():
        if value is None:
            continue
        number = _as_float(key, value)
        kind = TRAINING_INSTRUMENTS[key][1]
        if kind == "histogram":
            if not math.isfinite(number):
                continue  # a histogram bucket cannot hold NaN/inf
            instruments[key].record(number, attributes=attrs)
        elif kind == "counter":
            if number < 0 or not math.isfinite(number):
                raise ValueError(f"record_training_metrics: {key}={value!r} must be a finite count >= 0")
            instruments[key].add(int(number), attributes=attrs)
        else:
            instruments[key].set(number, attributes=attrs)
        recorded += 1
    return recorded
