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
    # Every rank exports: each iteration's root is emitted once (rank 0), all steps hang from it.
    exporter2 = InMemorySpanExporter()
    cfg2 = tel.TelemetryConfig(enabled=True, span_groups="per_step", metrics_enabled=False, rank_strategy="all_ranks")
    handle2 = tel.setup_telemetry(cfg2, rank, world_size, span_exporter=exporter2)
    with tel.managed_span("job", "megatron.train"):
        for iteration in (1, 2):
            with tel.iteration_step_span("step", iteration):
                with tel.managed_span("optimizer", "megatron.optimizer_step"):
                    pass
    handle2.force_flush(3000)
    all_ranks = [(s.name, s.context.trace_id, s.context.span_id, s.parent.span_id if s.parent else None,
                  [l.context.span_id for l in s.links]) for s in exporter2.get_finished_spans()]
    handle2.shutdown(timeout_ms=2000)
    return {"agreed": agreed, "run_id": handle.run_id, "exporting": handle.is_exporting, "carrier": carrier,
            "spans": spans, "all_ranks": all_ranks}


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
    # all_ranks: one exported root per iteration (from rank 0), both ranks' steps in its trace, no parent
    # id that no rank exported, every step linked to its rank's megatron.train.
    spans = r0["all_ranks"] + r1["all_ranks"]
    ids = {span_id for _, _, span_id, _, _ in spans}
    assert all(parent is None or parent in ids for _, _, _, parent, _ in spans)
    roots = {trace: span_id for name, trace, span_id, _, _ in r0["all_ranks"] if name == "megatron.iteration"}
    assert len(roots) == 2 and not [s for s in r1["all_ranks"] if s[0] == "megatron.iteration"]
    for per_rank in (r0["all_ranks"], r1["all_ranks"]):
        train = [span_id for name, _, span_id, _, _ in per_rank if name == "megatron.train"]
        steps = [s for s in per_rank if s[0] == "megatron.train_step"]
        assert len(steps) == 2
        for _, trace, _, parent, links in steps:
            assert roots[trace] == parent and links == train


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
