"""Training-loop side of telemetry: spans by group, the per-iteration trace, and step metrics.

Every function here is a no-op costing one frozenset lookup when telemetry is off, the group is
not selected, or this rank does not export.
"""
import time
import weakref

from megatron.core import parallel_state
from megatron.core.telemetry import (
    inject_context,
    is_span_group_enabled,
    iteration_step_span,
    iteration_trace_context,
    managed_span,
    record_training_metrics,
    safe_set_span_attributes,
    set_pipeline_carrier,
)
from megatron.core.telemetry.training_metrics import initialize_counters, observe_heartbeat
from megatron.training.global_vars import get_telemetry

# Unix time at which the last training iteration finished (the heartbeat), or None before the first.
_LAST_STEP_TIME = None
# Meters on which the counters' zero series and the heartbeat gauge are set up (once per meter).
_PREPARED_METERS = weakref.WeakSet()


def note_step_finished():
    """Remember that an iteration just finished (the heartbeat); a float store, called every iteration."""
    global _LAST_STEP_TIME
    _LAST_STEP_TIME = time.time()


def last_step_time():
    """Unix time (s) at which the last iteration finished, or None."""
    return _LAST_STEP_TIME


def span(group: str, name: str, **attrs):
    """``managed_span`` with attributes named ``megatron.<key>`` (e.g. ``iteration`` -> ``megatron.iteration``)."""
    if not is_span_group_enabled(group):
        return managed_span(group, name)  # the shared no-op context manager
    return managed_span(group, name, **{"megatron." + key: value for key, value in attrs.items()})


def step_span(iteration: int, first: bool = False):
    """The ``megatron.train_step`` span of ``iteration`` (1-based, as in the log line).

    Its trace derives from the run id, the launch uuid and the iteration, so every pipeline stage's
    spans of this iteration share one trace with no communication (spec section 7); its root,
    ``megatron.iteration``, is emitted by one rank, and the step links to ``megatron.train``. With the
    ``communication`` group on, the root's context is also stored as the pipeline carrier, the target of
    the schedules' ``megatron.pp.recv_forward.linked`` span links. The first iteration of
    a run is also emitted under the ``first_iteration`` group, so its compile/warm-up cost can be
    selected separately.
    """
    group = "first_iteration" if first and is_span_group_enabled("first_iteration") else "step"
    # The carrier only serves the pipeline schedules' linked receive spans: none without pipelining.
    step_on = is_span_group_enabled(group)
    links_on = is_span_group_enabled("communication") and parallel_state.get_pipeline_model_parallel_world_size() > 1
    if not (step_on or links_on):
        return managed_span(group, "megatron.train_step")
    handle = get_telemetry()
    if links_on:
        # The pipeline schedule's megatron.pp.recv_forward.linked spans link to the iteration's root.
        context = (iteration_trace_context(handle.run_id, iteration, launch_uuid=handle.launch_uuid)
                   if handle is not None and handle.run_id else None)
        set_pipeline_carrier(inject_context({}, context) if context is not None else None)
    if not step_on:
        return managed_span(group, "megatron.train_step")
    return iteration_step_span(group, iteration, handle)


def set_attributes(span_or_none, **attrs):
    """Set ``megatron.<key>`` attributes on a live span; ignores None spans and None values."""
    if span_or_none is None:
        return
    safe_set_span_attributes(
        span_or_none, {"megatron." + key: value for key, value in attrs.items() if value is not None}
    )


def _meter():
    handle = get_telemetry()
    if handle is None or not handle.is_exporting:
        return None
    meter = handle.meter
    if meter is not None and meter not in _PREPARED_METERS:
        # Every counter exists (at 0) from the first export; the heartbeat is read at each collection.
        initialize_counters(meter)
        observe_heartbeat(meter, last_step_time)
        _PREPARED_METERS.add(meter)
    return meter


def prepare_metrics():
    """Create the counters' zero series and the heartbeat gauge now (exporting ranks; else no-op)."""
    _meter()


def _export_now():
    # Gauges keep only their last value: snapshot them now or the next log interval overwrites them.
    handle = get_telemetry()
    if handle is not None and handle.is_exporting:
        handle.snapshot_metrics()


def record_step_metrics(elapsed_ms, loss, throughput_tflops, tokens_per_sec, grad_norm, skipped, learning_rate,
                        iteration=None, consumed_samples=None, seq_length=None):
    """The ``megatron.training.*`` instruments at a log iteration (exporting ranks only), then a
    snapshot for export, so every logged value reaches the exporter whatever
    ``OTEL_METRIC_EXPORT_INTERVAL`` is. ``skipped`` is the number of skipped iterations since the last
    log: it is added only when non-zero (the counter's zero series exists from the first export, see
    ``prepare_metrics``). Progress comes from the training loop's state: ``megatron.training.iteration``
    (``iteration``), ``consumed_samples`` and ``consumed_tokens`` (``consumed_samples`` x ``seq_length``,
    the run's ``DataConfig.seq_length``; taken from ``get_config()`` when the caller does not pass it)."""
    meter = _meter()
    if meter is None:
        return
    memory_gb = None
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        memory_gb = torch.cuda.max_memory_allocated() / 1e9
    if seq_length is None:
        from megatron.training.global_vars import get_config

        seq_length = get_config().data.seq_length
    samples = consumed_samples
    record_training_metrics(
        meter, step_duration_ms=elapsed_ms, loss=loss, throughput_tflops=throughput_tflops,
        tokens_per_sec=tokens_per_sec, grad_norm=grad_norm, skipped_iters=skipped or 0,
        learning_rate=learning_rate, memory_allocated_gb=memory_gb,
        iteration=iteration, consumed_samples=samples,
        consumed_tokens=samples * seq_length if samples is not None and seq_length else None,
    )
    _export_now()


def record_validation_metrics(loss, ppl, split="validation"):
    """``megatron.validation.loss`` / ``.ppl`` gauges (exporting ranks only), with the attribute
    ``megatron.split`` = ``split`` ("validation" or "test") so the final test-set evaluation forms its
    own series instead of ending the validation one."""
    meter = _meter()
    if meter is not None:
        record_training_metrics(meter, attributes={"megatron.split": split}, validation_loss=loss, validation_ppl=ppl)
        _export_now()
