"""The one hook every context-parallel kernel wraps its collectives in: step-breakdown part ``cp_comm`` + span.

A kernel writes ``with cp_comm_section("all_gather"): dist.all_gather_into_tensor(...)``; the block is
charged to the ``cp_comm`` part of the step breakdown (``megatron.core.step_timing``) and, when the
``communication`` span group is on, recorded as the span ``megatron.cp_comm.<name>``. With neither
installed it costs two global lookups (both return shared no-op context managers).
"""
import contextlib

from megatron.core import step_timing
from megatron.core.telemetry import managed_span

CP_COMM_PART = "cp_comm"


@contextlib.contextmanager
def cp_comm_section(name: str, **attrs):
    """Time the enclosed context-parallel collective as ``cp_comm`` and span it as ``megatron.cp_comm.<name>``.

    ``attrs`` become span attributes (e.g. ``**{"megatron.cp.bytes": n}``).
    """
    with step_timing.section(CP_COMM_PART), managed_span("communication", f"megatron.cp_comm.{name}", **attrs):
        yield
