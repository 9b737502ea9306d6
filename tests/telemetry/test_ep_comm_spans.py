"""The MoE dispatchers' hook ``ep_comm_section``: a ``megatron.ep_comm.<name>`` span in the ``communication``
group, a child of the enclosing microbatch / layer span (none when the group is off), and the ``ep_comm`` part
of the step breakdown (a section inside forward compute is charged to ep_comm alone)."""
from megatron.core import step_timing
from megatron.core import telemetry as tel
from megatron.core.transformer.moe.ep_comm import ep_comm_section
from telemetry_testutil import ManualClock, clean_telemetry, finished, setup_in_memory  # noqa: F401


def test_ep_comm_section_nests_under_the_microbatch_and_layer_spans():
    handle, spans, _ = setup_in_memory(tel.TelemetryConfig(enabled=True, span_groups="per_step,microbatch,layer"))
    with tel.managed_span("microbatch", "megatron.microbatch.forward"):
        with tel.managed_span("layer", "megatron.layer.mlp"):
            with ep_comm_section("dispatch_all_to_all", **{"megatron.ep.size": 2}):
                pass
    got = finished(handle, spans)
    comm, mlp, micro = (got["megatron.ep_comm.dispatch_all_to_all"], got["megatron.layer.mlp"],
                        got["megatron.microbatch.forward"])
    assert comm.parent.span_id == mlp.context.span_id and mlp.parent.span_id == micro.context.span_id
    assert comm.attributes["megatron.ep.size"] == 2


def test_ep_comm_section_makes_no_span_without_the_communication_group():
    handle, spans, _ = setup_in_memory(tel.TelemetryConfig(enabled=True, span_groups="default"))
    with ep_comm_section("combine_all_to_all"):
        pass
    assert finished(handle, spans) == {}


def test_ep_comm_section_is_charged_to_ep_comm():
    class Clock(ManualClock):  # a fresh class: its own ``now``
        pass

    recorder = step_timing.StepTimeRecorder(marks=Clock)
    step_timing.install(recorder)
    try:
        recorder.step_begin()
        with step_timing.section("backward_compute"):
            Clock.now += 1.0
            with ep_comm_section("combine_all_to_all"):
                Clock.now += 3.0
        recorder.step_end()
    finally:
        step_timing.uninstall()
    report = recorder.take()
    assert report["ep_comm"] == 3000.0 and report["backward_compute"] == 1000.0
    assert report["cp_comm"] == 0.0


def test_backward_of_the_dispatch_collectives_is_ep_comm():
    """The autograd functions' backward exchanges (all-to-all, gather's reduce-scatter, reduce-scatter's
    gather) are sectioned too, so a dispatcher's backward communication is not charged to backward_compute."""
    import torch

    from megatron.core.transformer.moe import collectives

    handle, spans, _ = setup_in_memory(tel.TelemetryConfig(enabled=True, span_groups="per_step,communication"))
    x = torch.randn(4, 3, requires_grad=True)
    # A group of one rank (None) makes each exchange the identity; the sections still open in backward.
    out = collectives._AllToAll.apply(None, x * 1.0, None, None)
    out = collectives._GatherFirstDim.apply(out, None, None)
    out = collectives._ReduceScatterFirstDim.apply(out, None, None)
    out.sum().backward()
    got = finished(handle, spans)
    for name in ("all_to_all_backward", "reduce_scatter_backward", "all_gather_backward"):
        assert f"megatron.ep_comm.{name}" in got, sorted(got)
    assert torch.equal(x.grad, torch.ones_like(x))
