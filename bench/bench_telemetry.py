"""Benchmark: telemetry cost, per call of a span helper and per training step.

``python bench/bench_telemetry.py [--calls N] [--repeats R]``: nanoseconds per call of disabled/enabled
``managed_span`` blocks and ``is_span_group_enabled`` (best of R repeats) and the ratio to an empty
``with nullcontext()`` block. Target (spec section 4): a disabled ``managed_span`` block <= 300 ns.

``python bench/bench_telemetry.py --training [--intervals N] [--repeats R] [--nproc P] [--model ...]``: the
step time of ``pretrain_gpt.py`` (mock data) with telemetry ``default``, ``per_step`` and ``all``, each
with the console exporter (one JSON line per span/snapshot, read and dropped by this process: a null
sink) and with OTLP/gRPC to a local receiver in this process, as ratios to telemetry off.

Whole runs of one configuration differ from each other by up to 10 % on a shared machine (memory
layout, the neighbours' load), and single iterations by 10 %, which hides a 2 % effect; two neighbouring
iterations of one run differ far less. So each run switches telemetry's per-step work on and off
iteration by iteration (``telemetry_toggle.py``): neighbours between log iterations form on/off pairs,
log iterations pair with the next log iteration, and the side that goes first alternates. The verdict is
the ratio of the on iterations' mean step time to the off iterations' (mixed as (L-1)/L non-log and 1/L
log iterations, L = ``--log-interval``), with a bootstrap 95 % confidence interval over pairs:

* wall: the training thread's step time, which is what the targets are about; the exporter threads
  run at their own moments and their effect (the GIL they hold) falls on on and off iterations alike;
* CPU: all threads of the rank, the on iterations also charged with every CPU-second spent off the
  training thread beyond what a telemetry-disabled run spends there: an upper bound, as if exporting
  stalled training outright (a machine with no spare core).

An A/A control (``MEGATRON_OTEL_ENABLED=0``, so nothing is switched and no SDK is imported) runs through
the same harness: its ratio shows the harness's own bias and noise.

Direct accounting, printed last: telemetry's own CPU per iteration = spans per iteration (counted in the
console runs) x CPU per span (start, end, OTLP protobuf encoding) + CPU per log interval's metrics
(record, snapshot, encoding) / ``--log-interval``, the unit costs measured in this process.

Targets (issue 13): ``default`` and ``per_step`` within 2 % of off, ``all`` within 10 %.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.core import telemetry as tel  # noqa: E402
from megatron.core.telemetry import state as tel_state  # noqa: E402


def _best_ns(stmt, calls: int, repeats: int) -> float:
    timer = timeit.Timer(stmt)
    return min(timer.repeat(repeat=repeats, number=calls)) / calls * 1e9


def _null_block():
    with nullcontext():
        pass


def _disabled_block():
    with tel.managed_span("microbatch", "megatron.microbatch.forward"):
        pass


def _disabled_block_attrs():
    with tel.managed_span("microbatch", "megatron.microbatch.forward", **{"megatron.microbatch_id": 3}):
        pass


def _enabled_block():
    with tel.managed_span("step", "megatron.train_step", **{"megatron.iteration": 3}):
        pass


def _group_check():
    tel.is_span_group_enabled("microbatch")


def _empty_call():
    pass


REPO = Path(__file__).resolve().parents[1]
# A small GPT whose CPU step (about 0.3 s) is still far shorter than a real one on a GPU; the tiny model
# of bench/RESULTS.md (2 layers, hidden 128, seq 128: 75 ms) is the worst case for a fixed per-step cost.
DEFAULT_MODEL = ("--num-layers 2 --hidden-size 256 --num-attention-heads 8 --seq-length 256 "
                 "--max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 8")


def _otlp_receiver():
    """A gRPC OTLP receiver on 127.0.0.1 that accepts and drops everything; returns (port, stop)."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            return trace_service_pb2.ExportTraceServiceResponse()

    class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(self, request, context):
            return metrics_service_pb2.ExportMetricsServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return port, lambda: server.stop(grace=None)


def _direct_costs(rounds: int = 20):
    """CPU cost of telemetry's own work, measured in this process with OTLP encoding exporters (the
    protobuf encoding the OTLP exporters do, without the network): (us of CPU per exported span,
    all threads; ms of CPU per log interval for the training, step-breakdown and straggler metrics
    with a snapshot and its export). Medians over ``rounds`` blocks, which a loaded machine disturbs
    less than whole training runs."""
    import statistics
    import time

    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from megatron.core.step_timing import PARTS
    from megatron.core.telemetry.metric_reader import LogIntervalMetricReader
    from megatron.core.telemetry.training_metrics import initialize_counters

    class EncodeSpans(SpanExporter):
        def export(self, spans):
            encode_spans(spans).SerializeToString()
            return SpanExportResult.SUCCESS

    class EncodeMetrics(MetricExporter):
        def export(self, metrics_data, timeout_millis=10_000, **kwargs):
            encode_metrics(metrics_data).SerializeToString()
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis=10_000):
            return True

        def shutdown(self, timeout_millis=30_000, **kwargs):
            pass

    reader = LogIntervalMetricReader(EncodeMetrics(), interval_ms=3_600_000)
    handle = tel.setup_telemetry(tel.TelemetryConfig(enabled=True, span_groups="all"), 0, 1,
                                 {"dl.local_rank": 0}, span_exporter=EncodeSpans(), metric_reader=reader)
    meter = handle.meter
    initialize_counters(meter)

    def log_interval(i):
        tel.record_training_metrics(meter, step_duration_ms=100.0 + i, loss=3.0, throughput_tflops=1.0,
                                    tokens_per_sec=1e4, grad_norm=1.0, skipped_iters=0, learning_rate=1e-4,
                                    iteration=i, consumed_samples=8 * i, consumed_tokens=1024 * i)
        tel.record_training_metrics(meter, attributes={"dl.rank": 0},
                                    **{f"step_{part}_ms": 1.0 for part in (*PARTS, "other", "total")})
        tel.record_training_metrics(meter, attributes={"dl.rank": 0}, rank_memory_rss_gb=1.0)
        tel.record_training_metrics(meter, straggler_slowest_compute_ms=1.0, straggler_fastest_compute_ms=1.0,
                                    straggler_ratio=1.0, straggler_slowest_rank=0, straggler_fastest_rank=0)
        handle.snapshot_metrics()

    span_us, interval_ms = [], []
    try:
        for i in range(rounds):
            t0 = time.process_time()
            for _ in range(200):
                with tel.managed_span("layer", "megatron.transformer_layer", **{"megatron.layer_number": 3}):
                    pass
            handle.force_flush(10_000)
            span_us.append((time.process_time() - t0) / 200 * 1e6)
            t0 = time.process_time()
            for j in range(5):
                log_interval(5 * i + j)
            handle.force_flush(10_000)
            interval_ms.append((time.process_time() - t0) / 5 * 1e3)
    finally:
        handle.shutdown(timeout_ms=5000)
    return statistics.median(span_us), statistics.median(interval_ms)


def _spans_per_iteration(stdout: str, iters: int) -> float:
    """Exported spans per iteration of a console-exporter run (start-up and job spans included)."""
    return sum(1 for line in stdout.splitlines() if line.startswith('{"name"')) / iters


def _step_times(data, picks=None, background_per_iter: float = 0.0):
    """(ms per iteration with telemetry on, ms per iteration off) from the paired samples of
    ``telemetry_toggle.py``: the log-interval mix of non-log and log iterations, (L-1)/L and 1/L.
    ``picks``: optional resampled pair indices ``{kind: [i, ...]}``. Wall and CPU as a dict. The CPU of
    the on iterations also carries the work done off the training thread (``extra_cpu_ms``: exporter
    threads, flushes) beyond ``background_per_iter`` ms per iteration, the same quantity in a run with
    telemetry disabled (gloo's threads and the like)."""
    interval = data["log_interval"]
    out = {}
    for clock in ("wall", "cpu"):
        per_side = {}
        for side in ("on", "off"):
            means = {}
            for kind in ("nonlog", "log"):
                values = data[f"{kind}_{side}_{clock}_ms"]
                chosen = values if picks is None else [values[i] for i in picks[kind]]
                means[kind] = sum(chosen) / len(chosen)
            per_side[side] = ((interval - 1) * means["nonlog"] + means["log"]) / interval
        if clock == "cpu":
            iterations = data["on_iterations"] + data["off_iterations"]
            extra = max(0.0, data["extra_cpu_ms"] - background_per_iter * iterations)
            per_side["on"] += extra / data["on_iterations"]
        out[clock] = (per_side["on"], per_side["off"])
    return out


def _background_per_iter(data) -> float:
    """CPU ms per iteration spent off the training thread in a run (``extra_cpu_ms`` over its iterations)."""
    return data["extra_cpu_ms"] / (data["on_iterations"] + data["off_iterations"])


def _ratios(data, resamples: int = 2000, seed: int = 0, background_per_iter: float = 0.0):
    """{clock: (on ms/iter, off ms/iter, on/off, 2.5th and 97.5th percentile of on/off)}: bootstrap over
    the pairs (non-log and log pairs resampled separately)."""
    import random

    rng = random.Random(seed)
    point = _step_times(data, background_per_iter=background_per_iter)
    boots = {"wall": [], "cpu": []}
    sizes = {kind: len(data[f"{kind}_on_wall_ms"]) for kind in ("nonlog", "log")}
    for _ in range(resamples):
        picks = {kind: [rng.randrange(n) for _ in range(n)] for kind, n in sizes.items()}
        for clock, (on, off) in _step_times(data, picks, background_per_iter).items():
            boots[clock].append(on / off)
    out = {}
    for clock, (on, off) in point.items():
        ratios = sorted(boots[clock])
        out[clock] = (on, off, on / off, ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1])
    return out


def _paired_run(env_extra, args, port):
    """One pretrain_gpt.py run under ``telemetry_toggle.py``: its ``BENCH_PAIRED`` record (rank 0's),
    and the run's stdout."""
    import json
    import os
    import subprocess

    from telemetry_toggle import PREFIX

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_"))}
    env.update(OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(REPO), BENCH_WARMUP_INTERVALS="2", **env_extra)
    if env_extra.get("MEGATRON_OTEL_EXPORTER") == "otlp":
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}", OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           str(Path(__file__).resolve().parent / "telemetry_toggle.py"), *args.model.split(), "--train-iters",
           str(args.log_interval * (2 + args.intervals)), "--log-interval", str(args.log_interval), "--lr", "1e-4",
           "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--eval-iters", "0",
           "--distributed-backend", "gloo", "--num-workers", "0", "--seed", "1234"]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"run failed ({env_extra}):\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    lines = [json.loads(line[len(PREFIX):]) for line in result.stdout.splitlines() if line.startswith(PREFIX)]
    if not lines:
        raise RuntimeError(f"no {PREFIX} line in the output of {cmd}")
    return lines[0], result.stdout


def _merge(total, record):
    """Pool the pairs of repeated runs of one configuration."""
    if not total:
        return dict(record)
    merged = dict(total)
    for key, value in record.items():
        if isinstance(value, list):
            merged[key] = total[key] + value
        elif key != "log_interval":
            merged[key] = total[key] + value
    return merged


def training_benchmark(args) -> None:
    """Step-time ratios of the telemetry presets to off from neighbouring iterations of one run (see
    ``telemetry_toggle.py``), an A/A control, then the direct accounting of telemetry's own work."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.log_interval < 3 or args.log_interval % 2 == 0:
        raise SystemExit(f"--log-interval must be odd and >= 3 (pairs of neighbours between log iterations), "
                         f"got {args.log_interval}")
    targets = {"default": 1.02, "per_step": 1.02, "all": 1.10}
    configs = {"A/A control": {"MEGATRON_OTEL_ENABLED": "0"}}
    for exporter in args.exporters.split(","):
        for preset in targets:
            configs[f"{preset} ({exporter})"] = {"MEGATRON_OTEL_ENABLED": "1", "MEGATRON_OTEL_EXPORTER": exporter,
                                                 "MEGATRON_OTEL_SPAN_GROUPS": preset}
    port, stop = _otlp_receiver()
    pooled = {name: {} for name in configs}
    spans_per_iter = {}
    iters = args.log_interval * (2 + args.intervals)
    try:
        for repeat in range(args.repeats):
            for name, env_extra in configs.items():
                record, stdout = _paired_run(env_extra, args, port)
                pooled[name] = _merge(pooled[name], record)
                if env_extra.get("MEGATRON_OTEL_EXPORTER") == "console":
                    # Half the measured iterations export spans: count those of a whole run, on or off.
                    spans_per_iter[name.split(" ")[0]] = _spans_per_iteration(stdout, iters)
                if name == "A/A control":  # first in each round
                    background_now = _background_per_iter(record)
                r = _ratios(record, resamples=200, background_per_iter=background_now)
                print(f"repeat {repeat + 1}/{args.repeats} {name:<20} off {r['wall'][1]:7.2f} ms/iter, on/off wall "
                      f"{r['wall'][2]:.4f}, CPU {r['cpu'][2]:.4f}", flush=True)
    finally:
        stop()
    background = _background_per_iter(pooled["A/A control"])
    print(f"\n{'configuration':<20} {'on ms/iter':>10} {'off ms/iter':>11} {'wall on/off':>11} {'95% CI':>15} "
          f"{'CPU on/off':>10} {'95% CI':>15} {'target':>7}")
    for name, data in pooled.items():
        r = _ratios(data, background_per_iter=background)
        wall, cpu = r["wall"], r["cpu"]
        target = targets.get(name.split(" ")[0])
        verdict = ""
        if target is not None:
            verdict = "PASS" if wall[2] <= target else "FAIL"
            if wall[4] > target >= wall[2]:
                verdict += " (CI crosses the target)"
        print(f"{name:<20} {wall[0]:>10.2f} {wall[1]:>11.2f} {wall[2]:>11.4f} {f'{wall[3]:.4f}-{wall[4]:.4f}':>15} "
              f"{cpu[2]:>10.4f} {f'{cpu[3]:.4f}-{cpu[4]:.4f}':>15} "
              f"{'' if target is None else f'<={target:.2f}':>7} {verdict}")
    sample = next(iter(pooled.values()))
    print(f"(pairs per configuration: {len(sample['nonlog_on_wall_ms'])} of neighbouring iterations between log "
          f"iterations, {len(sample['log_on_wall_ms'])} of log iterations, over {args.repeats} run(s); ms/iter: "
          f"their log-interval mix. Wall: the training thread's step time, the verdict. CPU: all threads of the "
          f"rank, the on iterations also charged with all the work done off the training thread beyond the "
          f"{background:.2f} ms/iter of the control (exporter threads: an upper bound for a machine with no spare "
          "core). A/A control: telemetry disabled, so both sides are the same; its ratio shows the harness's bias "
          "and noise. 95% CI: bootstrap over pairs)")
    # Direct accounting: telemetry's own CPU work per iteration, from the span count of the console runs
    # and the cost of one span and of one log interval's metrics measured here.
    span_us, interval_ms = _direct_costs()
    off_cpu = _ratios(pooled["A/A control"], resamples=10)["cpu"][1]
    print(f"\ndirect cost: {span_us:.1f} us CPU per span (start, end, OTLP encoding), {interval_ms:.2f} ms CPU per "
          f"log interval (metrics, snapshot, OTLP encoding); off: {off_cpu:.2f} ms CPU per iteration")
    measured = args.intervals * args.log_interval
    for preset, target in targets.items():
        if preset in spans_per_iter:
            # Spans of a run / its iterations, of which the measured half are off: per on iteration.
            per_on = spans_per_iter[preset] * iters / (iters - measured / 2)
            extra = per_on * span_us / 1000.0 + interval_ms / args.log_interval
            print(f"{preset:<9} {per_on:6.1f} spans/iter -> {extra:6.2f} ms/iter = "
                  f"{1 + extra / off_cpu:.3f} x off (target <= {target:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000, help="calls per timing repeat (disabled paths)")
    parser.add_argument("--enabled-calls", type=int, default=5_000, help="calls per repeat (enabled path)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timing repeats (default 5); --training: rounds of runs (default 1)")
    parser.add_argument("--training", action="store_true", help="step time of pretrain_gpt.py per telemetry setting")
    parser.add_argument("--intervals", type=int, default=60,
                        help="--training: measured log intervals per run (after 2 of warm-up)")
    parser.add_argument("--log-interval", type=int, default=11, help="--training: log interval (odd)")
    parser.add_argument("--nproc", type=int, default=1, help="--training: ranks (gloo on CPU)")
    parser.add_argument("--threads", type=int, default=1, help="--training: OMP_NUM_THREADS per rank")
    parser.add_argument("--exporters", default="console,otlp", help="--training: comma-separated, of console, otlp")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="--training: model/batch flags of pretrain_gpt.py")
    args = parser.parse_args()
    if args.training:
        args.repeats = args.repeats or 1
        training_benchmark(args)
        return

    args.repeats = args.repeats or 5
    assert not tel_state.ENABLED_GROUPS, "telemetry must start disabled"
    results = {
        "empty function call": _best_ns(_empty_call, args.calls, args.repeats),
        "with nullcontext() block": _best_ns(_null_block, args.calls, args.repeats),
        "disabled managed_span block": _best_ns(_disabled_block, args.calls, args.repeats),
        "disabled managed_span block, 1 attr": _best_ns(_disabled_block_attrs, args.calls, args.repeats),
        "is_span_group_enabled": _best_ns(_group_check, args.calls, args.repeats),
    }

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    handle = tel.setup_telemetry(tel.TelemetryConfig(enabled=True, span_groups="per_step", metrics_enabled=False),
                                 rank=0, world_size=1, span_exporter=exporter)
    try:
        results["enabled managed_span block (in-memory exporter)"] = _best_ns(
            _enabled_block, args.enabled_calls, args.repeats)
        results["is_span_group_enabled (telemetry on)"] = _best_ns(_group_check, args.calls, args.repeats)
    finally:
        handle.shutdown(timeout_ms=5000)

    base = results["with nullcontext() block"]
    width = max(len(k) for k in results)
    print(f"{'measurement':<{width}}  {'ns/call':>10}  {'x nullcontext':>13}")
    for name, ns in results.items():
        print(f"{name:<{width}}  {ns:>10.1f}  {ns / base:>13.2f}")
    verdict = "PASS" if results["disabled managed_span block"] <= 300 else "FAIL"
    print(f"disabled managed_span target <= 300 ns: {verdict}")


if __name__ == "__main__":
    main()
