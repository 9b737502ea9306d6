"""Pipeline-parallel trace correlation: one trace per iteration across stages (spec section 7)."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, Mapping, Optional, Tuple

from . import state as _state
from .global_providers import default_tracer
from .helpers import _LiveSpanCM, _NULL_SPAN_CM, sanitize_attributes
from .propagation import extract_context, has_remote_span, inject_context

__all__ = ["iteration_span_ids", "iteration_sampled", "iteration_trace_context", "broadcast_trace_context",
           "create_linked_span", "iteration_step_span", "CARRIER_BYTES", "ITERATION_ROOT_SPAN"]

CARRIER_BYTES = 256
_TRACE_ID_LIMIT = (1 << 64) - 1


def iteration_span_ids(run_id: str, iteration: int, launch_uuid: Optional[str] = None) -> Tuple[int, int]:
    """``(trace_id, parent_span_id)`` of ``iteration``: the first 16 and next 8 bytes of
    SHA-256(``megatron.trace/{run_id}/{launch_uuid}/{iteration}``), or of
    ``megatron.trace/{run_id}/{iteration}`` without a launch uuid. Every stage computes the same pair
    without communicating, because run id and launch uuid are shared (resources.identity); the launch
    uuid (``TelemetryHandle.launch_uuid``) keeps a restart or requeue that reuses the run id from
    reusing its trace ids."""
    key = f"{run_id}/{launch_uuid}" if launch_uuid else f"{run_id}"
    digest = hashlib.sha256(f"megatron.trace/{key}/{int(iteration)}".encode()).digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1
    span_id = int.from_bytes(digest[16:24], "big") or 1
    return trace_id, span_id


def iteration_sampled(trace_id: int, environ: Optional[Mapping[str, str]] = None) -> bool:
    """The keep/drop decision ``OTEL_TRACES_SAMPLER`` would make for a new root with ``trace_id``.

    Ratio samplers decide from the low 64 bits of the trace id against ``round(rate * 2**64)``
    (the OpenTelemetry ``TraceIdRatioBased`` rule), so every stage reaches the same decision.
    """
    env = os.environ if environ is None else environ
    name = (env.get("OTEL_TRACES_SAMPLER") or "parentbased_always_on").strip().lower()
    if name in ("always_off", "parentbased_always_off"):
        return False
    if name in ("traceidratio", "parentbased_traceidratio"):
        try:
            rate = float(env.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))
        except ValueError:
            rate = 1.0
        rate = min(max(rate, 0.0), 1.0)
        return (trace_id & _TRACE_ID_LIMIT) < round(rate * (_TRACE_ID_LIMIT + 1))
    return True


def iteration_trace_context(run_id: str, iteration: int, sampled: Optional[bool] = None,
                            launch_uuid: Optional[str] = None):
    """An OpenTelemetry Context whose remote parent span is derived from
    ``run_id``, ``launch_uuid`` and ``iteration`` (``iteration_span_ids``): pass it as ``context=`` to the step span on every pipeline stage
    and all stages' spans of that iteration land in one trace, with zero communication. The parent
    itself is exported only when one rank emits it: use ``iteration_step_span``, which does.

    ``sampled`` defaults to ``iteration_sampled`` so ratio sampling stays consistent across stages.
    Returns ``None`` when OpenTelemetry is not installed.
    """
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    trace_id, span_id = iteration_span_ids(run_id, iteration, launch_uuid)
    if sampled is None:
        sampled = iteration_sampled(trace_id)
    span_context = trace.SpanContext(
        trace_id=trace_id, span_id=span_id, is_remote=True,
        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED if sampled else trace.TraceFlags.DEFAULT),
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context))


ITERATION_ROOT_SPAN = "megatron.iteration"
STEP_SPAN = "megatron.train_step"


class _IterationStepCM:
    """Enter: (on the root rank) start the iteration's root span, then the step span under it; link
    the step and the job span both ways. Exit: end both, the step first."""

    __slots__ = ("_group", "_iteration", "_handle", "_attrs", "_root", "_step")

    def __init__(self, group: str, iteration: int, handle, attrs):
        self._group, self._iteration, self._handle, self._attrs = group, int(iteration), handle, attrs
        self._root = self._step = None

    def __enter__(self):
        from opentelemetry import trace
        from opentelemetry.context import Context

        handle = self._handle
        job = trace.get_current_span()
        job_ctx = job.get_span_context()
        links = [trace.Link(job_ctx, {"megatron.link": "job"})] if job_ctx.is_valid else None
        attrs = {"megatron.iteration": self._iteration, **self._attrs}
        if handle.rank == getattr(handle, "iteration_root_rank", None) and handle.tracer_provider is not None:
            from .providers import start_span_with_ids

            trace_id, root_id = iteration_span_ids(handle.run_id, self._iteration, handle.launch_uuid)
            self._root = start_span_with_ids(handle.tracer, ITERATION_ROOT_SPAN, trace_id, root_id, links=links,
                                             attributes=sanitize_attributes(attrs))
            context = trace.set_span_in_context(self._root, Context())
        else:
            context = iteration_trace_context(handle.run_id, self._iteration, launch_uuid=handle.launch_uuid)
        self._step = _LiveSpanCM(STEP_SPAN, None, context, attrs, links=links)
        span = self._step.__enter__()
        if job.is_recording():  # the other direction: megatron.train -> this step (and its root)
            for target in (self._root, span):
                if target is not None:
                    job.add_link(target.get_span_context(), {"megatron.link": "step",
                                                             "megatron.iteration": self._iteration})
        return span

    def __exit__(self, exc_type, exc, tb):
        try:
            return self._step.__exit__(exc_type, exc, tb)
        finally:
            if self._root is not None:
                if exc is not None:
                    from opentelemetry.trace import Status, StatusCode

                    self._root.set_status(Status(StatusCode.ERROR, f"{exc_type.__name__}: {exc}"))
                self._root.end()


def iteration_step_span(group: str, iteration: int, handle=None, **attrs):
    """Context manager for iteration ``iteration``'s ``megatron.train_step`` span (``group`` is
    ``step`` or ``first_iteration``), yielding the span, or ``None`` when the group is off.

    Every pipeline stage puts its step into one trace per iteration without communicating: the
    trace id and the root's span id derive from run id, launch uuid and iteration
    (``iteration_span_ids``). The root is a real exported span, ``megatron.iteration``, emitted by
    exactly one rank (``TelemetryHandle.iteration_root_rank``: the lowest exporting rank), with the
    step span of that rank as its child; the other ranks' step spans name it as their (remote)
    parent, so no parent id dangles. Each step span (and the root) carries a Link to the enclosing
    ``megatron.train`` span, and ``megatron.train`` gets a Link back to each (the SDK keeps the most
    recent ``OTEL_SPAN_LINK_COUNT_LIMIT``, 128 by default). ``handle`` defaults to the live one;
    without a handle or run id it is a plain ``managed_span``.
    """
    if group not in _state.ENABLED_GROUPS:
        return _NULL_SPAN_CM
    handle = _state.live_handle() if handle is None else handle
    if handle is None or not handle.run_id:
        return _LiveSpanCM(STEP_SPAN, None, None, {"megatron.iteration": int(iteration), **attrs})
    return _IterationStepCM(group, iteration, handle, attrs)


def _fresh_traceparent() -> str:
    raw = os.urandom(24)
    trace_id = int.from_bytes(raw[:16], "big") or 1
    span_id = int.from_bytes(raw[16:], "big") or 1
    return f"00-{trace_id:032x}-{span_id:016x}-01"


def broadcast_trace_context(*args, **kwargs) -> Optional[Dict[str, str]]:
    """Share the source rank's trace context with every rank in one small broadcast.

    Two call shapes:

    * ours, ``broadcast_trace_context(context=None, src=0, group=None)``: ``context`` (default: the
      current one) of global rank ``src`` is sent to every rank of ``group``. Raises ``ValueError``
      when ``torch.distributed`` is not initialised.
    * nemo-lens's, ``broadcast_trace_context(rank, src_rank=0)`` (``rank`` an int, or the
      ``rank``/``src_rank`` keywords): the current context of ``src_rank`` over the default group;
      returns ``None`` when ``torch`` is missing or ``torch.distributed`` is not initialised.

    Collective: every rank of the group must call it, whatever its export decision, so gate the call
    only on conditions equal on all ranks (e.g. pipeline size > 1). If the source has no valid span
    (it does not export under the default strategy) it sends a fresh random context instead, so the
    other stages still share one trace (nemo-lens would send an empty carrier). The carrier (W3C
    ``traceparent``/``tracestate``) is stored for ``create_linked_span`` and returned.
    """
    reference_shape = ("rank" in kwargs or "src_rank" in kwargs
                       or (args and isinstance(args[0], int) and not isinstance(args[0], bool)))
    if reference_shape:
        names = ("rank", "src_rank")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        unknown = set(bound) - set(names)
        if unknown or len(args) > 2:
            raise TypeError(f"broadcast_trace_context(rank, src_rank=0): unexpected arguments {sorted(unknown)}")
        try:
            import torch.distributed as dist
        except ImportError:
            return None
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return _broadcast(None, int(bound.get("src_rank", 0)), None)
    names = ("context", "src", "group")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    unknown = set(bound) - set(names)
    if unknown or len(args) > 3:
        raise TypeError(f"broadcast_trace_context(context=None, src=0, group=None): unexpected arguments "
                        f"{sorted(unknown)}")
    return _broadcast(bound.get("context"), int(bound.get("src", 0)), bound.get("group"))


def _broadcast(context, src: int, group) -> Dict[str, str]:
    import torch
    import torch.distributed as dist

    # Imported here: telemetry stays importable without torch.
    from megatron.core.collective_device import get_collective_device

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("broadcast_trace_context: torch.distributed is not initialised")
    device = get_collective_device(group)
    buf = torch.zeros(CARRIER_BYTES, dtype=torch.uint8, device=device)
    if dist.get_rank() == src:
        carrier = inject_context({}, context)
        if "traceparent" not in carrier:
            carrier = {"traceparent": _fresh_traceparent()}
        payload = json.dumps(carrier, separators=(",", ":")).encode()
        if len(payload) > CARRIER_BYTES:  # an oversized tracestate/baggage is dropped, the parent is kept
            payload = json.dumps({"traceparent": carrier["traceparent"]}, separators=(",", ":")).encode()
        buf[: len(payload)] = torch.tensor(list(payload), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=group)
    carrier = json.loads(bytes(buf.cpu().tolist()).rstrip(b"\0").decode())
    _state.set_pipeline_carrier(carrier)
    return carrier


def _links_to(context) -> Optional[list]:
    if not has_remote_span(context):
        return None
    from opentelemetry import trace

    return [trace.Link(trace.get_current_span(context).get_span_context())]


def create_linked_span(*args, **keywords):
    """A span carrying an OpenTelemetry Link (not a parent) to a remote span context.

    Two call shapes:

    * ours, ``create_linked_span(name, carrier=None, tracer=None, group="communication", **attrs)``:
      a context manager for a span of ``group`` (e.g. ``megatron.pp.recv_forward.linked``), current
      inside the block, linked to the context in ``carrier`` (default: the carrier stored by
      ``broadcast_trace_context``). A no-op creating nothing when the group is off.
    * nemo-lens's, ``create_linked_span(tracer, name, remote_context=None, remote_carrier=None,
      **attrs)`` (the first argument is not a string): the span is started on ``tracer`` and returned;
      the caller ends it (``span.end()``, or ``with span:``). Not gated by a span group.

    A missing or invalid remote context gives a span without a link.
    """
    if args and not isinstance(args[0], str):
        names = ("tracer", "name", "remote_context", "remote_carrier")
        bound = dict(zip(names, args))
        for key in names:
            if key in keywords:
                if key in bound:
                    raise TypeError(f"create_linked_span: got multiple values for {key!r}")
                bound[key] = keywords.pop(key)
        if len(args) > len(names) or "name" not in bound:
            raise TypeError("create_linked_span(tracer, name, remote_context=None, remote_carrier=None, **attributes)")
        context = bound.get("remote_context")
        if context is None and bound.get("remote_carrier") is not None:
            context = extract_context(bound["remote_carrier"])
        tracer = bound["tracer"] or _state.TRACER or default_tracer()
        return tracer.start_span(bound["name"], links=_links_to(context),
                                 attributes=sanitize_attributes(keywords) or None)
    names = ("name", "carrier", "tracer", "group")
    bound = dict(zip(names, args))
    if len(args) > len(names):
        raise TypeError("create_linked_span(name, carrier=None, tracer=None, group='communication', **attrs)")
    for key in names:
        if key in keywords:
            if key in bound:
                raise TypeError(f"create_linked_span: got multiple values for {key!r}")
            bound[key] = keywords.pop(key)
    if "name" not in bound:
        raise TypeError("create_linked_span() needs a span name")
    group = bound.get("group", "communication")
    if group not in _state.ENABLED_GROUPS:
        return _NULL_SPAN_CM
    carrier = bound.get("carrier")
    if carrier is None:
        carrier = _state.get_pipeline_carrier()
    return _LiveSpanCM(bound["name"], bound.get("tracer"), None, keywords, links=_links_to(extract_context(carrier)))
