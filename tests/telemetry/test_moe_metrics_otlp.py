"""End to end with a real OTLP gRPC receiver: a 2-rank EP=2 MoE run (capacity factor 1) sends per-expert token
counts and dropped tokens that equal what its routers chose.

The reference comes from a wrapper around every router's ``routing`` (``tests/moe_routing_hook_pretrain.py``,
written per rank), not from the routing-stats recorder the metrics are built from: the tokens per expert
recomputed as the top-k of the router's logits (before dropping) and the returned routing map's sums (after
dropping). Each log interval's point per (layer, expert) must equal the recomputed counts of that interval's
iterations summed over both ranks, and the dropped tokens per layer their difference from the routing map's.
The same run checks that ``ep_comm`` is a part of the exported step breakdown and that the dispatchers'
``megatron.ep_comm.*`` spans hang under the layer spans."""
import json

import pytest

from pretrain_utils import _pretrain_argv, run_ranks
from telemetry_testutil import clean_telemetry  # noqa: F401
from test_telemetry_otlp import _grpc_receiver, _value

MICRO_BATCHES = 2  # global batch 8 = micro-batch 2 x DP 2 x 2
LOG_ITERATIONS = (1, 3, 6)  # --log-interval 3 (and the first iteration)


def _snapshots(received, name, by):
    """The exporting rank's points of gauge ``name`` per log iteration: ``{iteration: {attribute values: value}}``.

    Each export request is one log-interval snapshot (or a later re-export of the same values, at shutdown),
    labelled by the ``megatron.training.iteration`` gauge it carries; a re-export must repeat the values."""
    out = {}
    for request in received.metrics:
        iteration, points = None, {}
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name not in (name, "megatron.training.iteration"):
                        continue
                    assert metric.HasField("gauge"), metric.name
                    for point in metric.gauge.data_points:
                        value = point.as_double if point.HasField("as_double") else point.as_int
                        if metric.name != name:
                            iteration = int(value)
                            continue
                        attrs = {a.key: _value(a.value) for a in point.attributes}
                        points[tuple(attrs.get(k) for k in by)] = value
        if points:
            assert iteration is not None, name
            assert out.setdefault(iteration, points) == points, (name, iteration)
    return out


def _reference(hook_dir, num_layers, num_experts):
    """Per log iteration, from the routers' wrappers of both ranks: ``({(layer, expert): tokens chosen},
    {layer: (token, expert) pairs dropped})``."""
    windows = [(0, 1), (1, 3), (3, 6)]  # iterations (exclusive start, inclusive end) of each log line
    tokens = [{(layer, e): 0 for layer in range(1, num_layers + 1) for e in range(num_experts)} for _ in windows]
    dropped = [{layer: 0 for layer in range(1, num_layers + 1)} for _ in windows]
    for rank in (0, 1):
        calls = [c for c in json.loads((hook_dir / f"rank{rank}.json").read_text()) if c["grad"]]
        for layer in range(1, num_layers + 1):
            mine = [c for c in calls if c["layer"] == layer]
            assert len(mine) == LOG_ITERATIONS[-1] * MICRO_BATCHES, (rank, layer, len(mine))
            for w, (start, end) in enumerate(windows):
                for call in mine[start * MICRO_BATCHES:end * MICRO_BATCHES]:
                    assert all(a <= b for a, b in zip(call["after"], call["before"])), call
                    dropped[w][layer] += sum(call["before"]) - sum(call["after"])
                    for expert, count in enumerate(call["before"]):
                        tokens[w][(layer, expert)] += count
    return dict(zip(LOG_ITERATIONS, tokens)), dict(zip(LOG_ITERATIONS, dropped))


@pytest.mark.timeout(400)
def test_per_expert_counts_reach_the_receiver_and_equal_the_routers(shared_data, shakespeare_prefix, tmp_path,
                                                                    monkeypatch):
    received, port, stop = _grpc_receiver()
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    try:
        monkeypatch.setenv("MEGATRON_OTEL_ENABLED", "1")  # default strategy: the last rank (1) exports
        monkeypatch.setenv("MEGATRON_OTEL_SPAN_GROUPS", "per_step,microbatch,layer")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "600000")  # only the log-interval snapshots
        monkeypatch.setenv("MOE_ROUTING_HOOK_DIR", str(hook_dir))
        argv = _pretrain_argv(["--micro-batch-size", "2", "--train-iters", "6", "--log-interval", "3",
                               "--eval-interval", "100", "--disable-bias-linear", "--num-experts", "4",
                               "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
                               "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
                               "--moe-expert-capacity-factor", "1.0"],
                              shared_data, shakespeare_prefix, tmp_path)
        argv[0] = "tests/moe_routing_hook_pretrain.py"
        result = run_ranks(2, argv)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    finally:
        stop()

    expected, expected_dropped = _reference(hook_dir, num_layers=2, num_experts=4)
    tokens = _snapshots(received, "megatron.training.moe.tokens_per_expert",
                        ("megatron.moe.layer", "megatron.moe.expert"))
    assert tokens == expected
    # Every token of the interval is routed to 2 experts: 2 ranks x 64 tokens x 2 micro-batches x iterations x top-2.
    assert [sum(v for (layer, _), v in tokens[i].items() if layer == 1) for i in LOG_ITERATIONS] == [
        2 * 64 * MICRO_BATCHES * n * 2 for n in (1, 2, 3)]
    imbalance = _snapshots(received, "megatron.training.moe.imbalance", ("megatron.moe.layer",))
    assert sorted(imbalance) == list(LOG_ITERATIONS)
    for iteration, snap in imbalance.items():
        assert sorted(snap) == [(1,), (2,)]
        for (layer,), value in snap.items():
            counts = [expected[iteration][(layer, e)] for e in range(4)]
            assert value == pytest.approx(max(counts) / (sum(counts) / 4))
    dropped = _snapshots(received, "megatron.training.moe.dropped_tokens", ("megatron.moe.layer",))
    assert dropped == {i: {(layer,): n for layer, n in expected_dropped[i].items()} for i in LOG_ITERATIONS}
    assert sum(n for snap in dropped.values() for n in snap.values()) > 0  # the capacity factor did drop

    ep_comm = _snapshots(received, "megatron.training.step.ep_comm_ms", ("dl.rank",))
    assert sorted(ep_comm) == list(LOG_ITERATIONS)
    assert all(snap[(rank,)] > 0 for snap in ep_comm.values() for rank in (0, 1)), ep_comm

    spans = {span.span_id: span for request in received.traces for rs in request.resource_spans
             for ss in rs.scope_spans for span in ss.spans}
    comm = [span for span in spans.values() if span.name.startswith("megatron.ep_comm.")]
    assert comm, sorted({span.name for span in spans.values()})
    parents = {spans[span.parent_span_id].name for span in comm}
    assert "megatron.layer.mlp" in parents, parents  # the forward dispatch / combine, inside the MoE layer
    assert parents <= {"megatron.layer.mlp", "megatron.microbatch.forward", "megatron.microbatch.backward"}, parents
