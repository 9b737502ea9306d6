"""``megatron.training.moe.*``: the routers' counts summed over the ranks that route distinct tokens of a layer
(DP; TP only under sequence parallelism; PP stages fill their own layers), recorded with layer / expert labels
on the exporting rank only; nothing installed when telemetry metrics are off or the model has no MoE layer."""
import types

import pytest
import torch

from dist_utils import run_distributed
from megatron.core.transformer.moe import routing_stats
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.moe_metrics import MoERoutingReport


class _Meter:
    """A meter double: every gauge ``set`` as (instrument name, value, attributes)."""

    def __init__(self):
        self.points = []

    def create_gauge(self, name, unit=None, description=None):
        meter = self

        class _Gauge:
            def set(self, value, attributes=None):
                meter.points.append((name, value, dict(attributes or {})))

        return _Gauge()


def _config(**overrides):
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, add_bias_linear=False, num_moe_experts=4,
                moe_router_topk=2)
    return TransformerConfig(**{**base, **overrides})


def _handle(exporting, meter, metrics=True):
    return types.SimpleNamespace(config=types.SimpleNamespace(enabled=True, metrics_enabled=metrics),
                                 is_exporting=exporting, meter=meter)


def _scenario(rank, world_size, tp, pp, sequence_parallel):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    try:
        meter = _Meter()
        report = MoERoutingReport.create(_config(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 sequence_parallel=sequence_parallel), _handle(rank == 1, meter))
        layers = [1, 2] if pp == 1 else [rank + 1]  # PP=2: layer 1 on stage 0, layer 2 on stage 1
        for micro_batch in range(2):  # two micro-batches add up
            for layer in layers:
                counts = torch.tensor([rank + 1, 2 * layer, 0, micro_batch])
                routing_stats.record_routing(layer, counts, torch.tensor(layer + rank))
        with torch.no_grad():  # an evaluation forward: not counted
            routing_stats.record_routing(layers[0], torch.tensor([100, 100, 100, 100]), torch.tensor(7))
        table = report.report()
        again = report.report()  # nothing routed since: zeros
        report.close()
        return table.tolist(), again.abs().sum().item(), meter.points, routing_stats.active_recorder() is None
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.timeout(120)
def test_counts_are_summed_over_the_ranks_that_route_distinct_tokens():
    # DP=2: both ranks' tokens. Rank r, layer l, two micro-batches: [2(r+1), 4l, 0, 1], dropped 2(l+r).
    (table0, zero0, points0, off0), (table1, zero1, points1, off1) = run_distributed(_scenario, 2, 1, 1, False)
    expected = [[2 + 4, 4 + 4, 0, 2, 2 + 4], [6, 16, 0, 2, 4 + 6]]
    assert table0 == table1 == expected
    assert zero0 == zero1 == 0 and off0 and off1
    assert points0 == []  # rank 0 does not export
    first = {(name, attrs.get("megatron.moe.layer"), attrs.get("megatron.moe.expert")): value
             for name, value, attrs in points1[:12]}
    assert first[("megatron.training.moe.tokens_per_expert", 2, 1)] == 16
    assert first[("megatron.training.moe.tokens_per_expert", 1, 3)] == 2
    assert first[("megatron.training.moe.dropped_tokens", 2, None)] == 10
    assert first[("megatron.training.moe.imbalance", 1, None)] == pytest.approx(8 / (16 / 4))
    assert first[("megatron.training.moe.imbalance", 2, None)] == pytest.approx(16 / (24 / 4))
    # The second report: zero counts, no imbalance point (no tokens, no ratio).
    assert [name for name, _, _ in points1[12:]].count("megatron.training.moe.imbalance") == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_ranks_count_once_unless_sequence_parallel(sequence_parallel):
    (table0, *_), (table1, *_) = run_distributed(_scenario, 2, 2, 1, sequence_parallel)
    assert table0 == table1
    if sequence_parallel:  # each TP rank routes its own slice of the sequence
        assert table0 == [[6, 8, 0, 2, 6], [6, 16, 0, 2, 10]]
    else:  # the TP ranks route the same tokens: rank 0's alone
        assert table0 == [[2, 4, 0, 1, 2], [2, 8, 0, 1, 4]]


@pytest.mark.timeout(120)
def test_pipeline_stages_exchange_their_layers():
    (table0, *_), (table1, *_) = run_distributed(_scenario, 2, 1, 2, False)
    assert table0 == table1 == [[2, 4, 0, 1, 2], [4, 8, 0, 1, 6]]


def test_nothing_is_installed_without_metrics_or_experts():
    assert MoERoutingReport.create(_config(), None) is None
    assert MoERoutingReport.create(_config(), _handle(True, _Meter(), metrics=False)) is None
    dense = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2)
    assert MoERoutingReport.create(dense, _handle(True, _Meter())) is None
    assert routing_stats.active_recorder() is None
