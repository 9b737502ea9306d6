"""Process-wide telemetry state: the enabled span groups (lock-free reads) and the pipeline carrier."""
from __future__ import annotations

import os
from typing import Dict, FrozenSet, Optional

__all__ = [
    "ENABLED_GROUPS", "TRACER", "METER", "HANDLE", "activate", "deactivate", "get_enabled_groups",
    "set_enabled_groups", "is_span_group_enabled", "set_pipeline_carrier", "get_pipeline_carrier", "live_handle",
]

# Rebound (never mutated) so a reader sees either the old or the new frozenset, with no lock.
ENABLED_GROUPS: FrozenSet[str] = frozenset()
# Tracer/meter that gated helpers use when the caller passes none; None before setup_telemetry().
TRACER = None
METER = None
# The live TelemetryHandle of this process, for the double-initialisation guard.
HANDLE = None
HANDLE_PID: Optional[int] = None
# W3C carrier of the step's trace context shared between pipeline stages (see distributed.py).
PIPELINE_CARRIER: Optional[Dict[str, str]] = None


def activate(groups: FrozenSet[str], tracer, meter, handle) -> None:
    """Publish a new handle's groups, tracer and meter to the helpers of this process."""
    global ENABLED_GROUPS, TRACER, METER, HANDLE, HANDLE_PID
    TRACER, METER, HANDLE, HANDLE_PID = tracer, meter, handle, os.getpid()
    ENABLED_GROUPS = frozenset(groups)


def deactivate(handle=None) -> None:
    """Turn every gated helper into a no-op; with ``handle``, only if it is the live one."""
    global ENABLED_GROUPS, TRACER, METER, HANDLE, HANDLE_PID, PIPELINE_CARRIER
    if handle is not None and handle is not HANDLE:
        return
    ENABLED_GROUPS = frozenset()
    TRACER = METER = HANDLE = HANDLE_PID = None
    PIPELINE_CARRIER = None


def live_handle():
    """The handle set up in this very process (not one inherited through ``fork``), or None."""
    return HANDLE if HANDLE_PID == os.getpid() else None


def get_enabled_groups() -> FrozenSet[str]:
    """The frozenset of enabled span-group names (empty when disabled or not exporting)."""
    return ENABLED_GROUPS


def set_enabled_groups(groups) -> None:
    """Replace the enabled span groups (e.g. to turn on ``first_iteration`` spans for one step)."""
    global ENABLED_GROUPS
    ENABLED_GROUPS = frozenset(groups)


def is_span_group_enabled(group: str) -> bool:
    """Whether spans of ``group`` are emitted in this process: one frozenset lookup."""
    return group in ENABLED_GROUPS


def set_pipeline_carrier(carrier: Optional[Dict[str, str]]) -> None:
    """Store the step's trace-context carrier shared by pipeline stages."""
    global PIPELINE_CARRIER
    PIPELINE_CARRIER = dict(carrier) if carrier else None


def get_pipeline_carrier() -> Optional[Dict[str, str]]:
    """The carrier stored by ``set_pipeline_carrier`` or ``broadcast_trace_context``, or None."""
    return PIPELINE_CARRIER


def _after_fork_in_child() -> None:
    # A forked child (data-loader or checkpoint worker) must never emit through the parent's
    # providers; it may call setup_telemetry() itself to get its own.
    global ENABLED_GROUPS, TRACER, METER
    if HANDLE is not None:
        ENABLED_GROUPS = frozenset()
        TRACER = METER = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
