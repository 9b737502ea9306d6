"""Troubleshooting built in (issue 32, items 1-2): hang report, start-up watch, slow-step lines, on 2 gloo ranks.

The end-to-end tests run tests/hang_pretrain.py (pretrain_gpt.py with test-only data-fetch and
checkpoint hooks) as independent processes with torchrun's environment and wait for marker files and
log lines, never for a fixed time; every process they start is stopped in a ``finally``.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from dist_utils import free_port
from pretrain_utils import REPO, _pretrain_argv

from megatron.core.hang_monitor import blocked_in, monitor_interval, write_stacks
from megatron.core.progress import PROGRESS, in_section, phase_label
from megatron.training.step_breakdown import COLUMNS
from megatron.training.troubleshooting import SlowStepDetector, explain_slow_interval, slow_step_line

_SMALL = ["--micro-batch-size", "2", "--split", "100,0,0", "--eval-iters", "0"]
# Console telemetry on every rank: the span events and counters are checked in the output.
_TELEMETRY = {"MEGATRON_OTEL_ENABLED": "1", "MEGATRON_OTEL_EXPORTER": "console",
              "MEGATRON_OTEL_RANK_STRATEGY": "all_ranks"}


def _spans(output, name):
    """The console exporter's spans called ``name`` (one JSON object per line)."""
    prefix = '{"name":"' + name + '"'
    return [json.loads(line) for line in output.splitlines() if line.startswith(prefix)]


def _counter(output, name):
    """The last exported value of the counter ``name`` in ``output`` (console metrics), or None."""
    value = None
    for line in output.splitlines():
        if not line.startswith('{"resource_metrics"'):
            continue
        for resource in json.loads(line)["resource_metrics"]:
            for scope in resource["scope_metrics"]:
                for metric in scope["metrics"]:
                    if metric["name"] == name:
                        value = sum(point["value"] for point in metric["data"]["data_points"])
    return value


class _Ranks:
    """``nproc`` ranks (or only those in ``ranks``) of tests/hang_pretrain.py, each its own process with
    torchrun's variables, output to a file per rank."""

    def __init__(self, nproc, flags, shared_data, data_prefix, tmp_path, env=None, ranks=None, port=None):
        argv = [sys.executable, *_pretrain_argv(flags, shared_data, data_prefix, tmp_path)]
        argv[1] = str(REPO / "tests" / "hang_pretrain.py")
        self.port = port or free_port()
        self.procs, self.paths = {}, {}
        for rank in (range(nproc) if ranks is None else ranks):
            rank_env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port),
                            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                            LOCAL_WORLD_SIZE=str(nproc), PYTHONPATH=str(REPO), **(env or {}))
            self.paths[rank] = tmp_path / f"rank{rank}_{self.port}.log"
            with open(self.paths[rank], "w") as log:  # a file: no rank blocks on a full pipe
                self.procs[rank] = subprocess.Popen(argv, cwd=tmp_path, env=rank_env, stdout=log,
                                                    stderr=subprocess.STDOUT)

    def output(self, rank) -> str:
        return self.paths[rank].read_text(errors="replace")

    def wait_until(self, condition, what, timeout):
        """Poll ``condition()`` until true; a rank that ends first or the deadline fails the test."""
        deadline = time.monotonic() + timeout
        while not condition():
            ended = {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}
            assert not ended, f"ranks ended (statuses {ended}) before {what}\n{self.tail()}"
            assert time.monotonic() < deadline, f"no {what} within {timeout} s\n{self.tail()}"
            time.sleep(0.1)

    def tail(self) -> str:
        return "\n".join(f"--- rank {r}\n{self.output(r)[-2500:]}" for r in self.procs)

    def finish(self, timeout=120):
        statuses = {r: p.wait(timeout=timeout) for r, p in self.procs.items()}
        return statuses

    def kill(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()  # SIGKILL ends a stopped process too
                proc.wait()


@pytest.mark.timeout(180)
def test_sigstop_of_rank_1_is_named_by_rank_0_within_30_s(shared_data, shakespeare_prefix, tmp_path):
    """Rank 1 stops itself (SIGSTOP) while fetching data for iteration 3: with --hang-report-seconds 10,
    rank 0 prints one ``hang report:`` block naming rank 1, its pid, iteration 3 and phase data, what rank
    0 is blocked in, and a stack file; after SIGCONT the run ends normally on both ranks."""
    marker = tmp_path / "stopped"
    job = _Ranks(2, _SMALL + ["--train-iters", "5", "--hang-report-seconds", "10"], shared_data, shakespeare_prefix,
                 tmp_path, env={"MEGATRON_TEST_STOP_AT": "3:1", "MEGATRON_TEST_HOOK_MARKER": str(marker), **_TELEMETRY})
    try:
        job.wait_until(marker.exists, "SIGSTOP of rank 1", timeout=120)
        stopped = time.monotonic()
        job.wait_until(lambda: "hang report:" in job.output(0), "hang report on rank 0", timeout=30)
        took = time.monotonic() - stopped
        os.kill(job.procs[1].pid, signal.SIGCONT)
        statuses = job.finish()
    finally:
        job.kill()
    out0, out1 = job.output(0), job.output(1)
    assert statuses == {0: 0, 1: 0}, job.tail()
    assert took < 30
    assert out0.count("hang report:") == 1 and "hang report:" not in out1, job.tail()
    block = out0[out0.index("hang report:"):].split("\n")
    assert block[0].startswith("hang report: 1 rank(s) stopped reporting for 10 s or more") and block[0].endswith(": 1")
    pid1 = job.procs[1].pid
    assert re.fullmatch(rf"  rank 1 \(node \S+, pid {pid1}\): last seen \d+ s ago in iteration 3, phase data",
                        block[1]), block[1]
    # Rank 0 went on to its gradient all-reduce and waits there for rank 1.
    assert re.match(r"  waiting: rank 0 \(node \S+, pid \d+\) has not moved for \d+ s in iteration 3, phase backward, "
                    r"blocked in all_reduce on group data parallel \(ranks 0, 1\)", block[2]), block[2]
    stack_file = block[3].split(": ", 1)[1]
    assert block[3].startswith("  Python stacks of every thread of rank 0: ")
    assert os.path.dirname(stack_file) == str(tmp_path)  # no --save or --tensorboard-dir: the working directory
    stacks = open(stack_file).read()
    assert "--- thread MainThread" in stacks and "--- thread megatron-hang-monitor" in stacks
    assert "in start_grad_sync" in stacks
    # The same as a span event and a counter (rank 0 exports under all_ranks; rank 1 reported nothing).
    spans = _spans(out0, "megatron.hang_report")
    assert len(spans) == 1 and not _spans(out1, "megatron.hang_report")
    event = spans[0]["events"][0]
    assert event["name"] == "megatron.hang_report"
    attributes = event["attributes"]
    assert attributes["megatron.hang.stalled_ranks"] == [1] and attributes["megatron.hang.phase"] == "data"
    assert attributes["megatron.iteration"] == 3 and attributes["megatron.hang.seconds"] >= 10
    assert _counter(out0, "megatron.training.hang_reports") == 1 and _counter(out1, "megatron.training.hang_reports") == 0


@pytest.mark.timeout(180)
def test_slow_save_evaluation_and_data_fetch_give_no_hang_report_and_one_slow_step_line(
        shared_data, shakespeare_prefix, tmp_path):
    """--hang-report-seconds 1 while rank 1 is slow but alive: 3 s in an evaluation's data fetch, 3 s
    inside its checkpoint save, 2 s in the data fetch of iteration 8; rank 0 waits for it each time.
    No hang report; with --slow-step-factor 5 rank 0 prints the slow-step line naming data wait on rank 1
    for iteration 8."""
    flags = ["--micro-batch-size", "2", "--split", "98,2,0", "--train-iters", "10", "--eval-interval", "5",
             "--eval-iters", "1", "--save", str(tmp_path / "ckpt"), "--save-interval", "10",
             "--hang-report-seconds", "1", "--log-straggler", "--slow-step-factor", "5"]
    job = _Ranks(2, flags, shared_data, shakespeare_prefix, tmp_path,
                 env={"MEGATRON_TEST_SLOW_DATA": "8:1:2", "MEGATRON_TEST_SLOW_EVAL": "1:3",
                      "MEGATRON_TEST_SLEEP_IN_SAVE": "3", "MEGATRON_TEST_HOOK_RANK": "1", **_TELEMETRY})
    try:
        statuses = job.finish(timeout=150)
    finally:
        job.kill()
    out0, out1 = job.output(0), job.output(1)
    assert statuses == {0: 0, 1: 0}, job.tail()
    assert "hang report" not in out0 + out1, job.tail()
    assert "successfully saved checkpoint from iteration      10" in out0
    lines = [line for line in out0.splitlines() if line.startswith("iteration 8 took")]
    assert len(lines) == 1, job.tail()
    match = re.fullmatch(r"iteration 8 took ([0-9.]+)x the median: data wait \+([0-9.]+) s on rank 1", lines[0])
    assert match, lines[0]
    assert float(match.group(1)) > 5.0 and 1.8 <= float(match.group(2)) <= 3.5
    assert not [line for line in out1.splitlines() if " took " in line and line.startswith("iteration")]
    # The span event goes out once, from the lowest exporting rank (rank 0 under all_ranks).
    events = [span["events"][0]["attributes"] for span in _spans(out0, "megatron.slow_step")]
    assert not _spans(out1, "megatron.slow_step")
    event = next(e for e in events if e["megatron.iteration"] == 8)
    assert (event["megatron.slow_step.part"], event["megatron.slow_step.rank"]) == ("data_wait", 1)
    assert event["megatron.slow_step.ratio"] == pytest.approx(float(match.group(1)), rel=0.05)
    assert event["megatron.slow_step.delta_ms"] == pytest.approx(float(match.group(2)) * 1000, abs=10)
    assert _counter(out0, "megatron.training.slow_steps") == len(events)
    assert _counter(out0, "megatron.training.hang_reports") == 0


@pytest.mark.timeout(120)
def test_start_up_wait_names_the_address_and_the_ranks_not_joined(shared_data, shakespeare_prefix, tmp_path):
    """Rank 0 alone of a 2-rank world (rank 1 never starts) and, on another port, rank 1 alone (no rank 0,
    so no store): after --hang-report-seconds 2 each says where it waits and what is missing."""
    flags = _SMALL + ["--train-iters", "3", "--hang-report-seconds", "2"]
    alone0 = _Ranks(2, flags, shared_data, shakespeare_prefix, tmp_path, ranks=[0])
    alone1 = _Ranks(2, flags, shared_data, shakespeare_prefix, tmp_path, ranks=[1])
    try:
        alone0.wait_until(lambda: "hang report:" in alone0.output(0), "start-up report of rank 0", timeout=90)
        alone1.wait_until(lambda: "hang report:" in alone1.output(1), "start-up report of rank 1", timeout=90)
    finally:
        alone0.kill()
        alone1.kill()
    line0 = next(line for line in alone0.output(0).splitlines() if line.startswith("hang report:"))
    assert re.fullmatch(rf"hang report: rank 0 \(node \S+, pid \d+\) has waited \d+ s to initialise the process group "
                        rf"\(gloo, world size 2\) at 127\.0\.0\.1:{alone0.port}; ranks not joined yet: 1 \(1 of 2\)",
                        line0), line0
    line1 = next(line for line in alone1.output(1).splitlines() if line.startswith("hang report:"))
    assert f"at 127.0.0.1:{alone1.port}; no c10d store answers there: rank 0" in line1, line1


# ---------------------------------------------------------------------------------------------------
# In-process: the parts
# ---------------------------------------------------------------------------------------------------

def test_bad_values_of_the_flags_are_refused_naming_them():
    from megatron.training.arguments import parse_args, validate_args

    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "3", "--lr", "1e-3",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    for extra, message in ((["--hang-report-seconds", "-1"], "--hang-report-seconds must be >= 0"),
                           (["--slow-step-factor", "0.5"], "--slow-step-factor must be > 1"),
                           (["--hang-report-seconds", "0.01"], "--hang-report-seconds must be 0 .off. or a finite "
                                                               "number of seconds >= 1 .* got 0.01"),
                           (["--hang-report-seconds", "inf"], "--hang-report-seconds must be 0 .off. or a finite"),
                           (["--slow-step-factor", "inf"], "--slow-step-factor must be > 1 .* got inf")):
        with pytest.raises(ValueError, match=message):
            validate_args(parse_args(args=base + extra))
    args = validate_args(parse_args(args=base + ["--hang-report-seconds", "0", "--slow-step-factor", "0"]))
    assert (args.hang_report_seconds, args.slow_step_factor) == (0, 0)


def test_phase_labels_and_sections():
    assert phase_label("train", "backward") == "backward"
    assert phase_label("evaluation", "forward") == "evaluation (forward)"
    assert phase_label("checkpoint", None) == "checkpoint"
    saved = (PROGRESS.section, PROGRESS.phase)
    with in_section("checkpoint"):
        assert (PROGRESS.section, PROGRESS.phase) == ("checkpoint", None)
    assert (PROGRESS.section, PROGRESS.phase) == saved
    assert monitor_interval(10) == 2.0 and monitor_interval(600) == 10.0 and monitor_interval(0.5) == 0.2


def test_flight_recorder_entries_not_completed_are_listed():
    """The NCCL path's formatting, on entries in the flight recorder's format (as torch 2.13 pickles them;
    the NCCL dump itself needs CUDA and is not run here)."""
    from megatron.core.hang_monitor import flight_recorder_lines

    entries = [{"profiling_name": "nccl:all_reduce", "process_group": ("3", "undefined"), "collective_seq_id": 7,
                "state": "completed"},
               {"profiling_name": "nccl:reduce_scatter", "process_group": ("3", "DATA_PARALLEL"),
                "collective_seq_id": 8, "state": "started"},
               {"profiling_name": "nccl:all_gather", "process_group": ("5", "undefined"), "collective_seq_id": 2,
                "state": "scheduled"}]
    assert flight_recorder_lines(entries) == ["nccl:reduce_scatter on group DATA_PARALLEL (3) (seq 8, started)",
                                              "nccl:all_gather on group 5 (seq 2, scheduled)"]
    assert flight_recorder_lines(entries, limit=1) == ["nccl:all_gather on group 5 (seq 2, scheduled)"]


def test_blocked_in_names_the_collective_and_the_caller(tmp_path):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    # A frame chain as a blocked call leaves it: our code -> distributed_c10d.all_reduce(group=...).
    def fake_collective(group):
        return sys._getframe()

    code = fake_collective.__code__.replace(co_filename=distributed_c10d.__file__, co_name="all_reduce")
    frame = type(fake_collective)(code, {"sys": sys})(group=None)
    info = blocked_in(frame)
    assert info["collective"] == "all_reduce" and info["group"] == "world"
    assert info["where"].endswith("in test_blocked_in_names_the_collective_and_the_caller")
    assert blocked_in(sys._getframe())["collective"] is None
    path = write_stacks(str(tmp_path / "stacks.txt"), header="hdr")
    text = open(path).read()
    assert text.startswith("hdr\n--- thread ") and "test_blocked_in_names_the_collective_and_the_caller" in text
    del dist


def test_slow_step_detector_waits_for_warm_up_and_judges_against_the_median():
    detector = SlowStepDetector(3.0, rank=1)  # rank 1 prints nothing
    for iteration, seconds in enumerate([5.0, 4.0, 1.0, 1.1, 0.9, 1.0, 1.0, 3.5, 2.9], start=1):
        detector.step(iteration, seconds)
    # Iterations 1-2 are warm-up (never judged, never in the median); 8 is 3.5x the median 1.0, 9 is not.
    lines = detector.report(None, 1, 9)
    assert lines == ["iteration 8 took 3.5x the median: +2.50 s (--log-straggler or telemetry metrics name the "
                     "part of the step and the rank)"]
    assert detector.report(None, 10, 10) == []


def test_slow_step_detector_ignores_tiny_steps_that_jitter():
    detector = SlowStepDetector(3.0, rank=1)
    for iteration, seconds in enumerate([1.0, 1.0, 0.01, 0.01, 0.01, 0.01, 0.04, 0.3], start=1):
        detector.step(iteration, seconds)
    # 0.04 s is 4x the median but only 30 ms over it (under MIN_SLOW_STEP_EXCESS_S); 0.3 s is 290 ms over.
    assert [line.split(" took")[0] for line in detector.report(None, 1, 8)] == ["iteration 8"]


def _table(values):
    table = torch.zeros(len(values), len(COLUMNS), dtype=torch.float64)
    for rank, parts in enumerate(values):
        for part, ms in parts.items():
            table[rank, COLUMNS.index(part)] = ms
    return table


def test_the_part_that_grew_is_the_slow_ranks_own_not_the_waiting_ranks_communication():
    base = _table([{"forward_compute": 30, "data_wait": 1, "grad_sync": 5},
                   {"forward_compute": 30, "data_wait": 1, "grad_sync": 5}])
    slow = _table([{"forward_compute": 30, "data_wait": 1, "grad_sync": 2105},  # rank 0 waited for rank 1
                   {"forward_compute": 30, "data_wait": 2101, "grad_sync": 5}])
    assert explain_slow_interval(slow, base, 1, 2.1) == ("data_wait", 1, pytest.approx(2.1))
    # No baseline yet: each part against its median over the ranks.
    part, rank, _ = explain_slow_interval(slow, None, 1, 2.1)
    assert (part, rank) == ("data_wait", 1)
    # Over a 10-iteration interval the averaged breakdown is scaled back to the interval's excess.
    averaged = base.clone()
    averaged[1, COLUMNS.index("data_wait")] += 210.0
    assert explain_slow_interval(averaged, base, 10, 2.1) == ("data_wait", 1, pytest.approx(2.1))
    # One rank, no earlier interval: nothing to compare with, so no part is named.
    assert explain_slow_interval(slow[1:], None, 1, 2.1) == (None, None, 2.1)
    assert slow_step_line(8, 4.0, None, 2.1, None) == "iteration 8 took 4.0x the median: +2.10 s (no part of the step " \
        "breakdown grew)"
    assert slow_step_line(812, 3.4, "data_wait", 2.1, 5) == "iteration 812 took 3.4x the median: data wait +2.10 s on rank 5"
    assert slow_step_line(812, 3.4, "data_wait", 2.1, 5, (801, 900), 2).endswith(
        "(breakdown over iterations 801-900, 2 slow steps)")


@pytest.mark.timeout(60)
def test_monitor_reports_a_peer_that_stops_beating_once_and_not_one_that_keeps_beating(tmp_path):
    """In-process, on a HashStore: while this (main) thread sleeps, i.e. waits, a peer whose beat counter
    keeps changing is never reported; once its beats stop, exactly one report names it with the phase of
    its last beat, and ``on_report`` receives it."""
    import json
    import threading

    import torch.distributed as dist

    from megatron.core.hang_monitor import HangMonitor, store_prefix

    store = dist.HashStore()
    peer = dist.PrefixStore(store_prefix() + "beat/", store)
    beating = threading.Event()
    beating.set()
    finished = threading.Event()

    def beat():
        n = 0
        while not finished.is_set():
            if beating.is_set():
                n += 1
                peer.set("1", json.dumps({"n": n, "t": time.time(), "it": 7, "ph": "checkpoint", "host": "nodeB",
                                          "pid": 4242}))
            time.sleep(0.05)

    writer = threading.Thread(target=beat, daemon=True)
    writer.start()
    reports = []
    monitor = HangMonitor(0, 2, 0.6, report_dir=str(tmp_path), store=store, on_report=reports.append,
                          interval=0.1).start()
    PROGRESS.comm = ("p2p recv_forward with rank 1", None)  # as p2p_communication publishes its wait
    try:
        time.sleep(1.5)  # a long save on the peer: it beats, this rank waits
        assert reports == [] and monitor.beats > 5
        beating.clear()  # the peer's process stops
        deadline = time.monotonic() + 5.0
        while not reports and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # still one report while the stall lasts
    finally:
        PROGRESS.comm = None
        monitor.stop()
        finished.set()
    assert len(reports) == 1, [r.text for r in reports]
    assert "blocked in p2p recv_forward with rank 1 on group world" in reports[0].text
    report = reports[0]
    assert report.stalled_ranks == [1] and report.phase == "checkpoint" and report.seconds >= 0.5
    assert "  rank 1 (node nodeB, pid 4242): last seen" in report.text and "in iteration 7, phase checkpoint" in report.text
    assert os.path.exists(report.stack_file) and os.path.dirname(report.stack_file) == str(tmp_path)
    assert json.loads(dist.PrefixStore(store_prefix() + "beat/", store).get("0"))["pid"] == os.getpid()


@pytest.mark.timeout(60)
def test_a_stopped_store_host_is_reported_with_the_store_address(tmp_path):
    """The store's host process (rank 0's, under env://) is stopped: the heartbeat thread's store call
    blocks; the store watch reports within about N seconds, naming the address and rank 0."""
    import datetime

    import torch.distributed as dist

    from megatron.core.hang_monitor import HangMonitor

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c",
                               "import sys, time, torch.distributed as d\n"
                               f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False)\n"
                               "print('up', flush=True)\ntime.sleep(120)\n"], stdout=subprocess.PIPE, text=True)
    monitor = None
    try:
        assert server.stdout.readline().strip() == "up"
        client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=30))
        monitor = HangMonitor(1, 2, 1.0, report_dir=str(tmp_path), store=client, interval=0.2).start()
        os.kill(server.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        while not monitor.reports and time.monotonic() - stopped < 20:
            time.sleep(0.05)
        took = time.monotonic() - stopped
    finally:
        server.kill()  # SIGKILL ends a stopped process; the blocked store call then fails
        server.wait()
        if monitor is not None:
            monitor.stop()
    assert len(monitor.reports) == 1 and took < 5
    text = monitor.reports[0].text
    assert text.startswith("hang report: 1 rank(s) stopped reporting for 1 s or more (--hang-report-seconds): 0")
    assert f"the c10d store at 127.0.0.1:{port} has not answered for" in text and "rank 0's process serves it" in text
    assert monitor.reports[0].stalled_ranks == [0]
