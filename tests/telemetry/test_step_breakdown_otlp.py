"""End to end with a real OTLP gRPC receiver: the step breakdown and the straggler view arrive for every rank.

DP=2 (all_ranks, per_step): each rank's parts add up to the logged iteration time within 10%.
PP=2 (the default single_rank strategy: the last rank exports and relays the first's row): the stages'
p2p exchanges are ``pp_comm`` (stage 0's waits for its neighbour, not ``other``), each relayed row is
labelled with its own rank's coordinates, and the straggler view is per stage."""
import re

import pytest

from megatron.training.step_breakdown import STRAGGLER_RATIO_FLOOR_MS
from pretrain_utils import run_pretrain
from telemetry_testutil import clean_telemetry  # noqa: F401
from test_telemetry_otlp import _grpc_receiver, _value

PARTS = ("forward_compute", "backward_compute", "data_wait", "tp_comm", "pp_comm", "cp_comm", "ep_comm", "grad_sync",
         "optimizer", "other")


def _latest_gauges(received, by="dl.rank"):
    """The latest point of each (exporting rank, metric, point's ``by`` attribute) -> value; the resources
    by exporting rank; and the latest point's attributes under the same keys."""
    latest, resources = {}, {}
    for request in received.metrics:
        for rm in request.resource_metrics:
            resource = {a.key: _value(a.value) for a in rm.resource.attributes}
            resource_rank = resource["dl.rank"]
            resources[resource_rank] = resource
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if not metric.HasField("gauge"):
                        continue
                    for point in metric.gauge.data_points:
                        attrs = {a.key: _value(a.value) for a in point.attributes}
                        key = (resource_rank, metric.name, attrs.get(by))
                        if key not in latest or point.time_unix_nano >= latest[key][0]:
                            latest[key] = (point.time_unix_nano, point.as_double, attrs)
    return ({k: v for k, (_, v, _) in latest.items()}, resources, {k: a for k, (_, _, a) in latest.items()})


@pytest.mark.timeout(400)
def test_step_breakdown_and_straggler_metrics_reach_the_receiver(shared_data, shakespeare_prefix, tmp_path,
                                                                  monkeypatch):
    received, port, stop = _grpc_receiver()
    try:
        monkeypatch.setenv("MEGATRON_OTEL_ENABLED", "1")
        monkeypatch.setenv("MEGATRON_OTEL_RANK_STRATEGY", "all_ranks")
        monkeypatch.setenv("MEGATRON_OTEL_SPAN_GROUPS", "per_step")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "600000")  # only the log-interval snapshots
        # No ratio floor here: whether this tiny model's compute crosses 50 ms depends on the machine's load, and a
        # gauge keeps exporting the ratio of an earlier interval (the floor itself: tests/test_step_breakdown.py).
        monkeypatch.setenv("MEGATRON_OTEL_STRAGGLER_RATIO_FLOOR_MS", "0")
        out = run_pretrain(2, ["--micro-batch-size", "2", "--train-iters", "8", "--log-interval", "4",
                               "--eval-interval", "100", "--log-straggler"], shared_data, shakespeare_prefix, tmp_path)
    finally:
        stop()

    logged = {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)", out)}
    assert sorted(logged) == [1, 4, 8]
    straggler_lines = [line for line in out.splitlines() if "MnRtt/Rnk:" in line]
    assert len(straggler_lines) == 3 and all("MxRtt/Rnk:" in line and "MnDRtt/Rnk:" in line for line in straggler_lines)

    value, resources, _ = _latest_gauges(received)
    for rank in (0, 1):  # DP=2: where each rank sits in the layout is on its resource
        assert (resources[rank]["dl.tensor_parallel.rank"], resources[rank]["dl.pipeline_parallel.rank"],
                resources[rank]["dl.data_parallel.rank"]) == (0, 0, rank)
    for rank in (0, 1):
        assert value[(rank, "megatron.training.iteration", None)] == 8
        parts = {part: value[(rank, f"megatron.training.step.{part}_ms", rank)] for part in PARTS}
        total = value[(rank, "megatron.training.step.total_ms", rank)]
        assert sum(parts.values()) == pytest.approx(total, rel=1e-6)
        assert parts["forward_compute"] > 0 and parts["backward_compute"] > 0 and parts["optimizer"] > 0
        assert parts["grad_sync"] > 0  # data-parallel all-reduce of the gradients
        assert parts["other"] >= -0.01 * total, parts  # no part counted twice
        assert total == pytest.approx(logged[8], rel=0.10), (rank, parts, logged[8])
        assert value[(rank, "megatron.training.memory.rss_gb", rank)] > 0.05
        assert (rank, "megatron.training.last_step_timestamp", None) in value
    slowest = value[(0, "megatron.training.straggler.slowest_compute_ms", None)]
    fastest = value[(0, "megatron.training.straggler.fastest_compute_ms", None)]
    assert slowest >= fastest > 0
    assert value[(0, "megatron.training.straggler.gap_ms", None)] == pytest.approx(slowest - fastest)
    assert value[(0, "megatron.training.straggler.ratio", None)] == pytest.approx(slowest / fastest)
    computes = {r: value[(r, "megatron.training.step.forward_compute_ms", r)]
                + value[(r, "megatron.training.step.backward_compute_ms", r)] for r in (0, 1)}
    assert sorted(computes.values()) == pytest.approx([fastest, slowest])
    assert value[(0, "megatron.training.straggler.slowest_rank", None)] == max(computes, key=computes.get)
    assert (1, "megatron.training.straggler.ratio", None) not in value  # sent once, by the lowest exporting rank

    names = {span.name for request in received.traces for rs in request.resource_spans
             for ss in rs.scope_spans for span in ss.spans}
    assert {"megatron.data_loading", "megatron.grad_sync.start", "megatron.grad_sync.finish"} <= names


@pytest.mark.timeout(400)
def test_pipeline_breakdown_puts_the_stage_waits_in_pp_comm(shared_data, shakespeare_prefix, tmp_path, monkeypatch):
    received, port, stop = _grpc_receiver()
    try:
        monkeypatch.setenv("MEGATRON_OTEL_ENABLED", "1")  # default strategy: only the last rank (1) exports
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "600000")
        out = run_pretrain(2, ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", "--train-iters", "8",
                               "--log-interval", "4", "--eval-interval", "100"], shared_data, shakespeare_prefix,
                           tmp_path)
    finally:
        stop()
    assert "iteration        8/" in out
    value, resources, attributes = _latest_gauges(received)
    assert set(resources) == {1} and resources[1]["dl.pipeline_parallel.rank"] == 1
    for rank in (0, 1):  # rank 0's row is relayed by rank 1 and labelled as rank 0, stage 0
        attrs = attributes[(1, "megatron.training.step.pp_comm_ms", rank)]
        assert (attrs["dl.pipeline_parallel.rank"], attrs["dl.tensor_parallel.rank"],
                attrs["dl.data_parallel.rank"]) == (rank, 0, 0), attrs
        assert attrs["service.instance.id"] == f"{resources[1]['nemo.run.id']}-rank{rank}"
        assert attributes[(1, "megatron.training.memory.rss_gb", rank)] == attrs
        parts = {part: value[(1, f"megatron.training.step.{part}_ms", rank)] for part in PARTS}
        total = value[(1, "megatron.training.step.total_ms", rank)]
        assert sum(parts.values()) == pytest.approx(total, rel=1e-6)
        assert parts["pp_comm"] > 0, (rank, parts)  # every stage sends and receives
        assert parts["other"] >= -0.01 * total, (rank, parts)  # no part counted twice
    # Stage 0 computes little and waits for stage 1 (the output layer over GPT-2's 50k vocabulary and the
    # loss): that wait is its pipeline communication, so it outweighs what no part covers.
    stage0 = {part: value[(1, f"megatron.training.step.{part}_ms", 0)] for part in PARTS}
    assert stage0["pp_comm"] > stage0["other"], stage0
    # One straggler view per stage, each over that stage's one rank here (ratio 1), never stage 1 vs 0.
    by_stage, _, _ = _latest_gauges(received, by="dl.pipeline_parallel.rank")
    assert {k[2]: v for k, v in by_stage.items() if k[1] == "megatron.training.straggler.gap_ms"} == {0: 0.0, 1: 0.0}
    fastest = {k[2]: v for k, v in by_stage.items() if k[1] == "megatron.training.straggler.fastest_compute_ms"}
    assert {k[2]: v for k, v in by_stage.items() if k[1] == "megatron.training.straggler.ratio"} == {
        stage: 1.0 for stage, ms in fastest.items() if ms >= STRAGGLER_RATIO_FLOOR_MS}
    assert {k[2]: v for k, v in by_stage.items() if k[1] == "megatron.training.straggler.slowest_rank"} == {0: 0, 1: 1}
