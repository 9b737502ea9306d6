"""pretrain_gpt.py at PP=2 end to end: a stage that raises ends every rank quickly, naming it; the
telemetry of one iteration is one trace across both stages, with p2p spans under their micro-batch."""
import os
import re
import subprocess
import sys
import time

import pytest

from dist_utils import fork_ranks, free_port, rank_env, use_torchrun
from pretrain_utils import REPO, _pretrain_argv, run_pretrain

PP2 = ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", "--eval-interval", "1000"]


@pytest.mark.timeout(400)
def test_failing_last_stage_ends_every_rank_naming_it(shared_data, shakespeare_prefix, tmp_path):
    """Last stage raises in iteration 3: both ranks (independent processes, no torchrun to tear them
    down) exit non-zero within 60 s of the failure, and rank 0's error names rank 1."""
    argv = _pretrain_argv(PP2 + ["--train-iters", "6", "--distributed-timeout-minutes", "1"],
                          shared_data, shakespeare_prefix, tmp_path)
    argv = [str(REPO / "tests" / "pp_failing_pretrain.py"), *argv[1:]]
    port, logs = free_port(), [tmp_path / f"rank{rank}.log" for rank in range(2)]
    envs = [rank_env(dict(os.environ, OMP_NUM_THREADS="1"), rank, 2, port) for rank in range(2)]
    if use_torchrun():  # fresh interpreters
        procs = []
        try:
            for rank in range(2):
                with open(logs[rank], "w") as log:
                    procs.append(subprocess.Popen([sys.executable, *argv], cwd=REPO, env=envs[rank], stdout=log,
                                                  stderr=subprocess.STDOUT))
            statuses = [proc.wait(timeout=360) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    else:  # forked from the fork server, each rank to its own end
        statuses = fork_ranks(2, argv, envs, REPO, logs, logs, timeout=360, stop_others_on_failure=False)
    ended = time.time()
    out = [log.read_text() for log in logs]
    failed_at = re.search(r"injected failure at ([0-9.]+)", out[1])
    assert failed_at, out[1][-3000:]
    assert " iteration        2/" in out[1] and " iteration        3/" not in out[1], out[1][-3000:]
    assert all(status != 0 for status in statuses), (statuses, out[0][-2000:], out[1][-2000:])
    after_failure = ended - float(failed_at.group(1))
    print(f"both ranks ended {after_failure:.1f} s after the injected failure")
    assert after_failure < 60
    assert "pipeline stage failed on rank 1" in out[1], out[1][-3000:]
    assert "PipelinePeerError" in out[0] and "pipeline stage failed on rank 1" in out[0], out[0][-3000:]


def _spans(received):
    from opentelemetry.proto.common.v1 import common_pb2  # noqa: F401

    def value(v):
        return getattr(v, v.WhichOneof("value"))

    spans = []
    for request in received.traces:
        for rs in request.resource_spans:
            resource = {a.key: value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append({"name": s.name, "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                                  "parent": s.parent_span_id.hex(), "rank": resource["dl.rank"],
                                  "attrs": {a.key: value(a.value) for a in s.attributes}})
    return spans


def _run_with_receiver(monkeypatch, strategy, shared_data, prefix, tmp_path):
    sys.path.insert(0, str(REPO / "tests" / "telemetry"))
    from test_telemetry_otlp import _grpc_receiver

    received, port, stop = _grpc_receiver()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        monkeypatch.setenv("MEGATRON_OTEL_ENABLED", "1")
        monkeypatch.setenv("MEGATRON_OTEL_METRICS_ENABLED", "0")
        monkeypatch.setenv("MEGATRON_OTEL_SPAN_GROUPS", "per_step,communication,microbatch")
        monkeypatch.setenv("MEGATRON_OTEL_RANK_STRATEGY", strategy)
        run_pretrain(2, PP2 + ["--train-iters", "2", "--lr-warmup-iters", "1"], shared_data, prefix, tmp_path)
    finally:
        stop()
    return _spans(received)


def _check_p2p_under_microbatches(spans, rank):
    by_id = {s["id"]: s for s in spans}
    p2p = [s for s in spans if s["rank"] == rank and s["name"].startswith("megatron.p2p.")]
    expected = {0: {"megatron.p2p.send_forward", "megatron.p2p.recv_backward"},
                1: {"megatron.p2p.recv_forward", "megatron.p2p.send_backward"}}[rank]
    assert {s["name"] for s in p2p} == expected, sorted({s["name"] for s in p2p})
    for span in p2p:
        parent = by_id[span["parent"]]
        if parent["name"] == "megatron.pp.recv_forward.linked":
            parent = by_id[parent["parent"]]
        assert parent["name"].startswith("megatron.microbatch."), (span, parent)
        assert span["trace"] == parent["trace"]
        if "send" in span["name"]:  # a send runs in the span of the micro-batch it sends
            assert parent["attrs"]["megatron.microbatch_id"] == span["attrs"]["megatron.microbatch_id"]
    # 2 iterations x 4 micro-batches (global batch 8, micro batch 2, DP 1), each sent once each way
    # (the final evaluation's forward-only sends are in their own trace)
    train_traces = {s["trace"] for s in spans if s["rank"] == rank and s["name"] == "megatron.train_step"}
    assert len(train_traces) == 2
    assert len([s for s in p2p if s["trace"] in train_traces]) == 2 * 4 * 2


@pytest.mark.timeout(600)
def test_one_trace_per_iteration_across_stages(shared_data, shakespeare_prefix, tmp_path, monkeypatch):
    spans = _run_with_receiver(monkeypatch, "all_ranks", shared_data, shakespeare_prefix, tmp_path / "all")
    steps = [s for s in spans if s["name"] == "megatron.train_step"]
    by_iteration = {}
    for step in steps:
        by_iteration.setdefault(step["attrs"]["megatron.iteration"], {})[step["rank"]] = step["trace"]
    assert sorted(by_iteration) == [1, 2]
    for iteration, traces in by_iteration.items():
        assert sorted(traces) == [0, 1] and traces[0] == traces[1], (iteration, traces)
    assert by_iteration[1][0] != by_iteration[2][0]
    for rank in (0, 1):
        _check_p2p_under_microbatches(spans, rank)
    linked = [s for s in spans if s["name"] == "megatron.pp.recv_forward.linked"]
    assert {s["rank"] for s in linked} == {1}

    # Default strategy: only the last rank exports, and it still produces its p2p spans in the
    # iteration's trace (which needs no message from rank 0).
    monkeypatch.delenv("MEGATRON_OTEL_RANK_STRATEGY")
    default = _run_with_receiver(monkeypatch, "single_rank", shared_data, shakespeare_prefix, tmp_path / "default")
    assert {s["rank"] for s in default} == {1}
    _check_p2p_under_microbatches(default, 1)
    default_steps = {s["attrs"]["megatron.iteration"]: s["trace"] for s in default if s["name"] == "megatron.train_step"}
    assert sorted(default_steps) == [1, 2]
