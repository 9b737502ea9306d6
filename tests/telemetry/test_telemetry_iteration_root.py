"""Each iteration's trace has a real exported root (``megatron.iteration``, one rank), one trace id on
every pipeline stage without communication, and Links between ``megatron.train`` and each step."""
import pytest

from megatron.core import telemetry as tel
from megatron.core.telemetry.strategies import lowest_exporting_rank, rank_sample_fraction
from telemetry_testutil import clean_telemetry, finished, setup_in_memory  # noqa: F401


def _config(**kw):
    base = dict(enabled=True, span_groups="per_step", run_id="run-7", rank_strategy="all_ranks")
    base.update(kw)
    return tel.TelemetryConfig(**base)


def _train_one_step(iteration, step_span=None):
    step_span = step_span or (lambda it: tel.iteration_step_span("step", it))
    with tel.managed_span("job", "megatron.train") as train:
        with step_span(iteration) as step:
            with tel.managed_span("optimizer", "megatron.optimizer_step"):
                pass
    return train, step


def test_root_rank_emits_the_derived_root_with_links_both_ways():
    handle, spans, _ = setup_in_memory(_config(), rank=0, world_size=2)
    assert handle.iteration_root_rank == 0
    train, step = _train_one_step(5)
    got = finished(handle, spans)
    root, step_span, train_span = got["megatron.iteration"], got["megatron.train_step"], got["megatron.train"]
    trace_id, root_id = tel.iteration_span_ids("run-7", 5, handle.launch_uuid)
    assert root.parent is None and (root.context.trace_id, root.context.span_id) == (trace_id, root_id)
    assert step_span.parent.span_id == root_id and step_span.context.trace_id == trace_id
    assert root.attributes["megatron.iteration"] == 5 and step_span.attributes["megatron.iteration"] == 5
    # every parent id names an exported span
    ids = {s.context.span_id for s in got.values()}
    assert all(s.parent is None or s.parent.span_id in ids for s in got.values())
    # megatron.train -> step (and root) and step (and root) -> megatron.train
    train_id = train_span.context.span_id
    assert [link.context.span_id for link in step_span.links] == [train_id]
    assert [link.context.span_id for link in root.links] == [train_id]
    assert {link.context.span_id for link in train_span.links} == {root_id, step_span.context.span_id}
    assert step_span.end_time <= root.end_time


def test_other_ranks_hang_their_step_from_the_same_root_without_emitting_it():
    handle, spans, _ = setup_in_memory(_config(), rank=1, world_size=2)
    assert handle.iteration_root_rank == 0
    _train_one_step(5)
    got = finished(handle, spans)
    assert "megatron.iteration" not in got
    trace_id, root_id = tel.iteration_span_ids("run-7", 5, handle.launch_uuid)
    step = got["megatron.train_step"]
    assert step.context.trace_id == trace_id and step.parent.span_id == root_id and step.parent.is_remote
    assert [link.context.span_id for link in step.links] == [got["megatron.train"].context.span_id]


def test_training_loop_step_span_uses_it():
    from megatron.training import telemetry_hooks

    handle, spans, _ = setup_in_memory(_config(rank_strategy="single_rank"), rank=3, world_size=4)
    assert handle.iteration_root_rank == 3
    _train_one_step(2, lambda it: telemetry_hooks.step_span(it))
    got = finished(handle, spans)
    assert got["megatron.train_step"].parent.span_id == got["megatron.iteration"].context.span_id
    assert got["megatron.iteration"].parent is None


def test_disabled_group_creates_nothing():
    handle, spans, _ = setup_in_memory(_config(span_groups="default"), rank=0, world_size=2)
    with tel.iteration_step_span("step", 1) as span:
        assert span is None
    assert "megatron.iteration" not in finished(handle, spans)


@pytest.mark.parametrize("kw,world,expected", [
    (dict(rank_strategy="single_rank"), 4, 3),
    (dict(rank_strategy="single_rank", export_rank=1), 4, 1),
    (dict(rank_strategy="all_ranks"), 4, 0),
    (dict(rank_strategy="first_rank_per_node"), 16, 0),
    (dict(rank_strategy="sampled", export_sample_rate=0.0), 8, None),
])
def test_lowest_exporting_rank(kw, world, expected):
    assert lowest_exporting_rank(tel.TelemetryConfig(**kw), world) == expected


def test_lowest_exporting_rank_sampled_custom_and_rank_aware():
    sampled = tel.TelemetryConfig(rank_strategy="sampled", export_sample_rate=0.3)
    first = min(r for r in range(64) if rank_sample_fraction(r) < 0.3)
    assert lowest_exporting_rank(sampled, 64) == first
    assert tel.should_export(sampled, first, 64)
    assert lowest_exporting_rank(tel.TelemetryConfig(), 9, strategy=lambda c, r, w: r % 3 == 2) == 2
    aware = tel.TelemetryConfig(rank_strategy="all_ranks", sampling_strategy="rank_aware", export_sample_rate=0.3)
    assert lowest_exporting_rank(aware, 64) == first  # a rank the sampler drops never emits the root
