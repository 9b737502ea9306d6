"""Two gloo ranks: one shared run id, one trace per iteration across stages, and the broadcast carrier
under the default strategy (rank 0 does not export)."""
import os

from dist_utils import run_distributed

from megatron.core import telemetry as tel
from telemetry_testutil import clean_telemetry  # noqa: F401


def _ranks_body(rank, world_size):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    for name in [n for n in os.environ if n.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "SLURM_", "TORCHELASTIC_"))]:
        del os.environ[name]
    agreed = tel.resolve_run_id(None, world_size)  # no launcher id: one broadcast from rank 0
    exporter = InMemorySpanExporter()
    cfg = tel.TelemetryConfig(enabled=True, span_groups="all", metrics_enabled=False)
    handle = tel.setup_telemetry(cfg, rank, world_size, span_exporter=exporter)
    carrier = tel.broadcast_trace_context(src=0)  # rank 0 has no span and does not export
    ctx = tel.iteration_trace_context(handle.run_id, 3)
    with tel.managed_span("step", "megatron.train_step", context=ctx, **{"megatron.iteration": 3}):
        with tel.create_linked_span("megatron.pp.recv_forward.linked", **{"dl.pipeline_parallel.rank": rank}):
            pass
    handle.force_flush(3000)
    spans = {s.name: (s.context.trace_id, s.parent.span_id if s.parent else None,
                      [(l.context.trace_id, l.context.span_id) for l in s.links])
             for s in exporter.get_finished_spans()}
    handle.shutdown(timeout_ms=2000)
    return {"agreed": agreed, "run_id": handle.run_id, "exporting": handle.is_exporting, "carrier": carrier,
            "spans": spans}


def test_pipeline_stages_share_run_id_and_trace():
    r0, r1 = run_distributed(_ranks_body, 2, timeout=120)
    assert r0["agreed"] == r1["agreed"] and len(r0["agreed"]) == 12
    assert r0["run_id"] == r1["run_id"]  # from the launcher's shared MASTER_ADDR/PORT, or the broadcast
    assert (r0["exporting"], r1["exporting"]) == (False, True)
    assert r0["carrier"] == r1["carrier"] and r0["carrier"]["traceparent"].startswith("00-")
    assert r0["spans"] == {}
    trace_id, parent_id = tel.iteration_span_ids(r1["run_id"], 3)
    step = r1["spans"]["megatron.train_step"]
    assert step[:2] == (trace_id, parent_id)
    _, link_trace, link_span, _ = r1["carrier"]["traceparent"].split("-")
    linked = r1["spans"]["megatron.pp.recv_forward.linked"]
    assert linked[0] == trace_id and linked[2] == [(int(link_trace, 16), int(link_span, 16))]


def test_iteration_context_is_deterministic_and_sampler_consistent(monkeypatch):
    a = tel.iteration_span_ids("run", 10)
    assert a == tel.iteration_span_ids("run", 10) != tel.iteration_span_ids("run", 11)
    assert a != tel.iteration_span_ids("other", 10)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    from opentelemetry.sdk.trace.sampling import Decision, TraceIdRatioBased

    reference = TraceIdRatioBased(0.25)
    for it in range(200):
        trace_id, _ = tel.iteration_span_ids("run", it)
        expected = reference.should_sample(None, trace_id, "s").decision == Decision.RECORD_AND_SAMPLE
        assert tel.iteration_sampled(trace_id) == expected
        flags = tel.iteration_trace_context("run", it)
        from opentelemetry import trace

        assert trace.get_current_span(flags).get_span_context().trace_flags.sampled == expected
