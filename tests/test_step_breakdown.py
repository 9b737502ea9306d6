"""Step-time breakdown: exclusive accounting of nested parts, the Timers hook, the straggler line, one gather per log."""
import contextlib
import re
import time

import pytest
import torch

from megatron.core import step_timing
from megatron.core.step_timing import PARTS, StepTimeRecorder
from megatron.core.timers import Timers
from megatron.training import step_breakdown
from megatron.training.step_breakdown import COLUMNS, StepBreakdown, straggler_line


class FakeMarks:
    """A clock the test advances by hand; ``deferred`` mimics CUDA events (resolved in take())."""

    def __init__(self, deferred):
        self.deferred = deferred
        self.now = 0.0
        self.resolved = 0

    def mark(self):
        return [self.now]  # a mutable box: a deferred mark's value is read only at resolve time

    def elapsed(self, start, end):
        return end[0] - start[0]

    def resolve(self):
        self.resolved += 1


@pytest.fixture(autouse=True)
def no_recorder():
    yield
    step_timing.uninstall()


@pytest.mark.parametrize("deferred", [False, True])
def test_nested_parts_are_charged_exclusively(deferred):
    marks = FakeMarks(deferred)
    rec = StepTimeRecorder(marks=marks)
    rec.begin("forward_compute")  # outside a step: ignored (evaluation, checkpoint)
    marks.now += 5
    rec.end("forward_compute")
    for _ in range(2):
        rec.step_begin()
        rec.begin("forward_compute")
        marks.now += 1
        rec.begin("data_wait")
        marks.now += 2
        rec.end("data_wait")
        rec.begin("tp_comm")
        marks.now += 3
        rec.end("tp_comm")
        marks.now += 4
        rec.end("forward_compute")
        rec.begin("optimizer")
        marks.now += 5
        rec.end("optimizer")
        marks.now += 6  # nothing covers this: "other"
        rec.step_end()
    report = rec.take()
    assert report["steps"] == 2
    assert report["forward_compute"] == pytest.approx(5000.0)  # (1 + 4) s, per step, in ms
    assert report["data_wait"] == pytest.approx(2000.0) and report["tp_comm"] == pytest.approx(3000.0)
    assert report["optimizer"] == pytest.approx(5000.0)
    assert report["total"] == pytest.approx(21000.0) and report["other"] == pytest.approx(6000.0)
    assert sum(report[p] for p in PARTS) + report["other"] == pytest.approx(report["total"])
    assert marks.resolved == (1 if deferred else 0)
    again = rec.take()  # reset after take
    assert again["steps"] == 0 and again["total"] == 0.0


def test_end_of_an_outer_part_closes_inner_ones_and_unknown_ends_are_ignored():
    marks = FakeMarks(False)
    rec = StepTimeRecorder(marks=marks)
    rec.step_begin()
    rec.end("optimizer")  # never begun: ignored
    rec.begin("backward_compute")
    rec.begin("tp_comm")
    marks.now += 2
    rec.end("backward_compute")  # tp_comm left open: closed with it
    rec.step_end()
    report = rec.take()
    assert report["tp_comm"] == pytest.approx(2000.0) and report["backward_compute"] == pytest.approx(0.0)


def test_skipped_parts_stay_in_the_enclosing_part():
    marks = FakeMarks(True)
    rec = StepTimeRecorder(marks=marks, skip_parts=("tp_comm",))
    rec.step_begin()
    rec.begin("forward_compute")
    rec.begin("tp_comm")
    marks.now += 2
    rec.end("tp_comm")
    rec.end("forward_compute")
    rec.step_end()
    report = rec.take()
    assert report["tp_comm"] == 0.0 and report["forward_compute"] == pytest.approx(2000.0)


def test_section_is_a_shared_noop_without_a_recorder():
    assert step_timing.section("tp_comm") is step_timing.section("data_wait")
    assert isinstance(step_timing.section("tp_comm"), contextlib.nullcontext)


def test_megatron_timers_charge_parts_even_below_the_timing_log_level():
    timers = Timers(log_level=0)
    timer = timers("forward-compute", log_level=2)  # a no-op timer at level 0 ...
    timer.start()
    timer.stop()
    marks = FakeMarks(False)
    rec = StepTimeRecorder(marks=marks)
    step_timing.install(rec)
    rec.step_begin()
    timers("forward-compute", log_level=2).start()
    marks.now += 0.25
    timers("forward-compute", log_level=2).stop()
    timers("all-grads-sync", log_level=1).start()
    marks.now += 0.5
    timers("all-grads-sync", log_level=1).stop()
    rec.step_end()
    report = rec.take()  # ... yet the breakdown sees it
    assert report["forward_compute"] == pytest.approx(250.0) and report["grad_sync"] == pytest.approx(500.0)
    assert "forward-compute" not in timers._timers  # the printed timers are unchanged


def test_data_iterator_wrapper_charges_data_wait():
    rec = StepTimeRecorder(use_cuda_events=False)
    step_timing.install(rec)

    def slow():
        while True:
            time.sleep(0.02)
            yield 1

    it = step_breakdown.wrap_data_iterator(slow())
    assert step_breakdown.wrap_data_iterator(it) is it and step_breakdown.wrap_data_iterator(None) is None
    rec.step_begin()
    next(it)
    rec.step_end()
    assert rec.take()["data_wait"] >= 15.0


def _table(compute_ms, data_ms, exports, stages=None):
    """Gathered table of ranks with these compute/data-wait times and export flags; ``stages`` are
    the ranks' pipeline stages (default all 0: data parallel ranks 0..N-1)."""
    rows = []
    stages = stages or [0] * len(compute_ms)
    for rank, (compute, data, flag) in enumerate(zip(compute_ms, data_ms, exports)):
        row = dict.fromkeys(COLUMNS, float("nan"))
        row.update({part: 0.0 for part in PARTS}, exports=float(flag), other=1.0, rss_gb=0.5 + rank)
        dp = sum(1 for s in stages[:rank] if s == stages[rank])
        row.update(tensor_parallel_rank=0.0, pipeline_parallel_rank=float(stages[rank]), data_parallel_rank=float(dp),
                   local_rank=float(rank))
        row.update(forward_compute=compute / 2, backward_compute=compute / 2, data_wait=data)
        row["total"] = compute + data + 1.0
        rows.append([row[c] for c in COLUMNS])
    return torch.tensor(rows, dtype=torch.float64)


def test_straggler_line_has_megatrons_fields():
    line = straggler_line(_table([100.0, 150.0, 120.0], [3.0, 1.0, 2.0], [0, 0, 1]), flops_per_rank=3e12,
                          now="2026-01-02 03:04:05")
    assert line == ("[2026-01-02 03:04:05] | MnRtt/Rnk: 100.00ms/0 | MxRtt/Rnk: 150.00ms/1 | "
                    "MnDRtt/Rnk: 1.00ms/1 | MxDRtt/Rnk: 3.00ms/0 | MnEtpt/Rnk: 20.00TF/1 | MxEtpt/Rnk: 30.00TF/0")
    assert re.fullmatch(r"\[[^\]]+\]( \| M[nx]\w+/Rnk: [0-9.]+[a-zA-Z%]+/\d+)+", line)


def test_minmax_count_lists_the_lowest_and_highest_ranks():
    table = _table([100.0, 150.0, 120.0, 90.0], [1.0] * 4, [0, 0, 0, 1])
    lines = step_breakdown.straggler_rank_lines(table, flops_per_rank=3e12, count=2)
    assert lines == ["^^^^ Bottom 2 Ranks with lowest  Etpt(TF): 20.00/1, 25.00/2,",
                     "^^^^ Top    2 Ranks with highest Etpt(TF): 30.00/0, 33.33/3,"]
    assert step_breakdown.straggler_rank_lines(table, 3e12, count=1) == []  # --straggler-minmax-count 1: none
    assert step_breakdown.straggler_rank_lines(table, 3e12, count=4) == []  # not below the world size


class _Meter:
    """Records (name, value, attributes) of every gauge set."""

    def __init__(self):
        self.points = []

    def create_gauge(self, name, unit="", description=""):
        points = self.points

        class Gauge:
            def set(self, value, attributes=None):
                points.append((name, value, dict(attributes or {})))

        return Gauge()

    create_counter = create_histogram = create_gauge


def test_lowest_exporting_rank_sends_the_rows_of_silent_ranks_and_the_straggler_view():
    table = _table([100.0, 150.0, 120.0], [3.0, 1.0, 2.0], exports=[0, 1, 1])
    lead, other = _Meter(), _Meter()
    StepBreakdown(1, 3, lead, False, recorder=StepTimeRecorder(use_cuda_events=False))._record(table)
    StepBreakdown(2, 3, other, False, recorder=StepTimeRecorder(use_cuda_events=False))._record(table)
    ranks = lambda meter: sorted({a["dl.rank"] for n, _, a in meter.points if n.endswith("forward_compute_ms")})
    assert ranks(lead) == [0, 1] and ranks(other) == [2]  # every rank exactly once
    straggler = {n: v for n, v, _ in lead.points if ".straggler." in n}
    assert straggler == {"megatron.training.straggler.slowest_compute_ms": 150.0,
                         "megatron.training.straggler.fastest_compute_ms": 100.0,
                         "megatron.training.straggler.gap_ms": 50.0,
                         "megatron.training.straggler.ratio": 1.5,
                         "megatron.training.straggler.slowest_rank": 1,
                         "megatron.training.straggler.fastest_rank": 0}
    assert not [n for n, _, _ in other.points if ".straggler." in n]
    rss = {a["dl.rank"]: v for n, v, a in lead.points if n == "megatron.training.memory.rss_gb"}
    assert rss == {0: 0.5, 1: 1.5}


def test_straggler_view_compares_ranks_of_one_pipeline_stage():
    # PP=2 x DP=2 (ranks 0, 1 on stage 0; 2, 3 on stage 1): stage 1 holds 3x the work of stage 0.
    table = _table([100.0, 110.0, 300.0, 330.0], [1.0] * 4, exports=[1, 0, 0, 0], stages=[0, 0, 1, 1])
    meter = _Meter()
    StepBreakdown(0, 4, meter, False, recorder=StepTimeRecorder(use_cuda_events=False))._record(table)
    view = {}
    for name, value, attrs in meter.points:
        if ".straggler." in name:
            view.setdefault(attrs["dl.pipeline_parallel.rank"], {})[name.rsplit(".", 1)[1]] = value
    assert view == {0: {"slowest_compute_ms": 110.0, "fastest_compute_ms": 100.0, "ratio": pytest.approx(1.1),
                        "gap_ms": pytest.approx(10.0), "slowest_rank": 1, "fastest_rank": 0},
                    1: {"slowest_compute_ms": 330.0, "fastest_compute_ms": 300.0, "ratio": pytest.approx(1.1),
                        "gap_ms": pytest.approx(30.0), "slowest_rank": 3, "fastest_rank": 2}}  # never 330 / 100 = 3.3
    # A stage-level series names its stage and nothing else of the rank that sends it.
    assert {tuple(attrs) for name, _, attrs in meter.points if ".straggler." in name} == {("dl.pipeline_parallel.rank",)}


def test_no_straggler_ratio_below_the_compute_floor():
    # A healthy PP=2 run where stage 0 computes ~13 ms: 27 vs 13 ms read as a 2.1x straggler before.
    assert step_breakdown.STRAGGLER_RATIO_FLOOR_MS == 50.0
    table = _table([13.0, 27.0, 300.0, 310.0], [1.0] * 4, exports=[1, 0, 0, 0], stages=[0, 0, 1, 1])
    view = step_breakdown.stage_stragglers(table)
    assert view[0]["straggler_ratio"] is None and view[0]["straggler_gap_ms"] == pytest.approx(14.0)
    assert view[1]["straggler_ratio"] == pytest.approx(310.0 / 300.0) and view[1]["straggler_gap_ms"] == pytest.approx(10.0)
    meter = _Meter()
    StepBreakdown(0, 4, meter, False, recorder=StepTimeRecorder(use_cuda_events=False))._record(table)
    ratios = {a["dl.pipeline_parallel.rank"]: v for n, v, a in meter.points if n == "megatron.training.straggler.ratio"}
    assert ratios == {1: pytest.approx(310.0 / 300.0)}  # stage 0's ratio is not recorded at all
    assert step_breakdown.stage_stragglers(table, ratio_floor_ms=10.0)[0]["straggler_ratio"] == pytest.approx(27 / 13)


def test_relayed_rows_carry_their_own_ranks_coordinates():
    # Only rank 3 exports: it relays ranks 0-2, each labelled as itself, not as rank 3.
    table = _table([100.0, 110.0, 300.0, 330.0], [1.0] * 4, exports=[0, 0, 0, 1], stages=[0, 0, 1, 1])
    meter = _Meter()
    StepBreakdown(3, 4, meter, False, recorder=StepTimeRecorder(use_cuda_events=False), run_id="r1")._record(table)
    rows = {a["dl.rank"]: a for n, _, a in meter.points if n == "megatron.training.step.total_ms"}
    assert rows == {r: {"dl.rank": r, "dl.tensor_parallel.rank": 0, "dl.pipeline_parallel.rank": r // 2,
                        "dl.data_parallel.rank": r % 2, "dl.local_rank": r, "service.instance.id": f"r1-rank{r}"}
                    for r in range(4)}
    memory = {a["dl.rank"]: a for n, _, a in meter.points if n == "megatron.training.memory.rss_gb"}
    assert memory == rows


def test_own_row_coordinates_come_from_parallel_state(monkeypatch):
    from megatron.core import parallel_state

    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_data_parallel_rank", lambda: 0)
    breakdown = StepBreakdown(7, 8, None, False, recorder=StepTimeRecorder(use_cuda_events=False))
    try:
        row = breakdown.gather()[0]  # not initialised torch.distributed: this rank's row alone
    finally:
        breakdown.close()
    coords = [float(row[COLUMNS.index(c)]) for c in ("tensor_parallel_rank", "pipeline_parallel_rank",
                                                     "data_parallel_rank", "local_rank")]
    assert coords == [1.0, 2.0, 0.0, 3.0]


def _gather_worker(rank, world_size):
    calls = []
    real = step_breakdown._all_gather_flat

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    step_breakdown._all_gather_flat = counting
    meter = _Meter() if rank == 1 else None  # rank 1 exports (single_rank's default choice)
    breakdown = StepBreakdown(rank, world_size, meter, log_straggler=True)
    for _ in range(2):
        breakdown.step_begin()
        with step_timing.section("forward_compute"):
            time.sleep(0.01 if rank == 0 else 0.1)  # rank 1 is the straggler (10x: robust to a loaded machine)
        breakdown.step_end()
    table = breakdown.report(flops_per_rank=1e9)
    breakdown.close()
    return len(calls), table.tolist(), meter.points if meter else None


@pytest.mark.timeout(180)
def test_one_gather_per_report_and_the_straggler_is_found():
    from dist_utils import run_distributed

    results = run_distributed(_gather_worker, 2, timeout=150)
    assert [r[0] for r in results] == [1, 1]  # ONE collective per log interval on every rank
    table = torch.tensor(results[0][1])
    assert torch.equal(table.nan_to_num(-1.0), torch.tensor(results[1][1]).nan_to_num(-1.0))  # same on both
    assert table[1, COLUMNS.index("forward_compute")] > 2 * table[0, COLUMNS.index("forward_compute")]
    points = results[1][2]
    assert {a["dl.rank"] for n, _, a in points if n == "megatron.training.step.forward_compute_ms"} == {0, 1}
    assert dict((n, v) for n, v, _ in points)["megatron.training.straggler.slowest_rank"] == 1


def test_straggler_flags_reach_the_breakdown():
    from megatron.training.arguments import parse_args
    from megatron.training.config import LoggerConfig

    def logger_config(*flags):  # the flags' LoggerConfig, as the config builder makes it
        args = vars(parse_args(args=list(flags)))
        return LoggerConfig(log_straggler=args["log_straggler"], straggler_minmax_count=args["straggler_minmax_count"])

    breakdown = StepBreakdown.create(logger_config("--log-straggler", "--straggler-minmax-count", "3"), handle=None)
    assert breakdown.log_straggler and breakdown.minmax_count == 3 and breakdown.meter is None  # on without telemetry
    breakdown.close()
    assert StepBreakdown.create(logger_config(), handle=None) is None  # neither flag nor telemetry: off
    assert step_timing.active_recorder() is None


def test_ratio_floor_comes_from_the_telemetry_setting():
    import types

    from megatron.core.telemetry import TelemetryConfig

    config = TelemetryConfig.from_env(environ={"MEGATRON_OTEL_ENABLED": "1",
                                               "MEGATRON_OTEL_STRAGGLER_RATIO_FLOOR_MS": "5"}).validate()
    handle = types.SimpleNamespace(config=config, is_exporting=False, meter=None, run_id=None)
    logger = types.SimpleNamespace(log_straggler=False, straggler_minmax_count=1)
    breakdown = StepBreakdown.create(logger, handle)
    try:
        assert breakdown.ratio_floor_ms == 5.0
    finally:
        breakdown.close()
    with pytest.raises(ValueError, match="MEGATRON_OTEL_STRAGGLER_RATIO_FLOOR_MS=-1.0 must be a number of milliseconds"):
        TelemetryConfig.from_env(environ={"MEGATRON_OTEL_STRAGGLER_RATIO_FLOOR_MS": "-1"}).validate()
