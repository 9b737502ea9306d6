"""The one hook every MoE token dispatcher wraps its expert-parallel collectives in: part ``ep_comm`` + span.

A dispatcher writes ``with ep_comm_section("dispatch_all_to_all"): ...``; the block is charged to the
``ep_comm`` part of the step breakdown (``megatron.core.step_timing``) and, when the ``communication``
span group is on, recorded as the span ``megatron.ep_comm.<name>``. With neither installed it costs two
global lookups (both return shared no-op context managers).
"""
import contextlib

from megatron.core import step_timing
from megatron.core.telemetry import managed_span

EP_COMM_PART = "ep_comm"


@contextlib.contextmanager
def ep_comm_section(name: str, **attrs):
    """Time the enclosed expert-parallel collective as ``ep_comm`` and span it as ``megatron.ep_comm.<name>``.

    ``attrs`` become span attributes (e.g. ``**{"megatron.ep.tokens": n}``).
    """
    with step_timing.section(EP_COMM_PART), managed_span("communication", f"megatron.ep_comm.{name}", **attrs):
        yield
