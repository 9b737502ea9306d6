"""End to end (2 ranks, all_ranks, per_step, real OTLP gRPC receiver): the step breakdown and the straggler
view arrive for both ranks, and each rank's parts add up to the logged iteration time within 10%."""
import re

import pytest

from pretrain_utils import run_pretrain
from telemetry_testutil import clean_telemetry  # noqa: F401
from test_telemetry_otlp import _grpc_receiver, _value

PARTS = ("forward_compute", "backward_compute", "data_wait", "tp_comm", "pp_comm", "grad_sync", "optimizer", "other")


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
        out = run_pretrain(2, ["--micro-batch-size", "2", "--train-iters", "8", "--log-interval", "4",
                               "--eval-interval", "100", "--log-straggler"], shared_data, shakespeare_prefix, tmp_path)
    finally:
        stop()

    logged = {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)", out)}
    assert sorted(logged) == [1, 4, 8]
    straggler_lines = [line for line in out.splitlines() if "MnRtt/Rnk:" in line]
    assert len(straggler_lines) == 3 and all("MxRtt/Rnk:" in line and "MnDRtt/Rnk:" in line for line in straggler_lines)

    # The latest point of each (metric, dl.rank), per exporting rank; the last snapshot is iteration 8's.
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
                        key = (resource_rank, metric.name, attrs.get("dl.rank"))
                        if key not in latest or point.time_unix_nano >= latest[key][0]:
                            latest[key] = (point.time_unix_nano, point.as_double)
    value = {key: v for key, (_, v) in latest.items()}
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
    assert value[(0, "megatron.training.straggler.ratio", None)] == pytest.approx(slowest / fastest)
    computes = {r: value[(r, "megatron.training.step.forward_compute_ms", r)]
                + value[(r, "megatron.training.step.backward_compute_ms", r)] for r in (0, 1)}
    assert sorted(computes.values()) == pytest.approx([fastest, slowest])
    assert value[(0, "megatron.training.straggler.slowest_rank", None)] == max(computes, key=computes.get)
    assert (1, "megatron.training.straggler.ratio", None) not in value  # sent once, by the lowest exporting rank

    names = {span.name for request in received.traces for rs in request.resource_spans
             for ss in rs.scope_spans for span in ss.spans}
    assert {"megatron.data_loading", "megatron.grad_sync.start", "megatron.grad_sync.finish"} <= names
