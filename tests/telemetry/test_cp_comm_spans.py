"""The context-parallel kernels' hook ``cp_comm_section``: a ``megatron.cp_comm.<name>`` span in the
``communication`` group (none when the group is off) and the ``cp_comm`` part of the step breakdown."""
from megatron.core import step_timing
from megatron.core import telemetry as tel
from megatron.core.transformer.context_parallel.comm import cp_comm_section
from telemetry_testutil import ManualClock, clean_telemetry, finished, setup_in_memory  # noqa: F401


def test_cp_comm_section_is_a_communication_span():
    handle, spans, _ = setup_in_memory(tel.TelemetryConfig(enabled=True, span_groups="per_step"))
    with cp_comm_section("all_gather", **{"megatron.cp.size": 2}):
        pass
    got = finished(handle, spans)
    assert set(got) == {"megatron.cp_comm.all_gather"}
    assert got["megatron.cp_comm.all_gather"].attributes["megatron.cp.size"] == 2


def test_cp_comm_section_makes_no_span_without_the_communication_group():
    handle, spans, _ = setup_in_memory(tel.TelemetryConfig(enabled=True, span_groups="default"))
    with cp_comm_section("reduce_scatter"):
        pass
    assert finished(handle, spans) == {}


def test_cp_comm_section_is_charged_to_cp_comm():
    class Clock(ManualClock):  # a fresh class: its own ``now``
        pass

    recorder = step_timing.StepTimeRecorder(marks=Clock)
    step_timing.install(recorder)
    try:
        recorder.step_begin()
        with step_timing.section("forward_compute"):
            Clock.now += 1.0
            with cp_comm_section("all_gather"):
                Clock.now += 2.0
        recorder.step_end()
    finally:
        step_timing.uninstall()
    report = recorder.take()
    assert report["cp_comm"] == 2000.0 and report["forward_compute"] == 1000.0
