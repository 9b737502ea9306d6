"""Benchmark: soak, resident memory of each pipeline stage over a long run, telemetry on vs off.

``python bench/bench_soak.py [--iters N] [--rounds R] [--pp P] [--span-groups SPEC] [--tracemalloc]``

Runs ``pretrain_gpt.py`` (mock data or ``--data``, a tiny GPT, gloo, ``--pipeline-model-parallel-size P``) under
``soak_rank.py`` for N iterations, alternately with telemetry off and on (``MEGATRON_OTEL_ENABLED=1``,
the default ``single_rank`` strategy, i.e. the last rank exports, OTLP/gRPC to a receiver in this
process that accepts and drops everything), R rounds, all launched from this process. Each rank samples
its RSS and the garbage collector's object count every ``--sample-every`` iterations.

Reported per setting and pipeline stage: RSS at the first sample after ``--warmup`` iterations and at
the end, and the least-squares slope after the warm-up in MB per 1,000 iterations (and GC-tracked
objects per 1,000 iterations: a Python-level leak grows them, a native one or allocator fragmentation
does not). The verdict is the slope of "on" next to "off" of the same stage: telemetry leaks only if
its stage's slope is above off's by more than the rounds' spread. With ``--tracemalloc`` the runs
list the source lines whose live Python allocations grew most after the warm-up (tracing inflates RSS:
read the slopes of a run without it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODEL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
         "--micro-batch-size 2 --global-batch-size 8")
MOCK_DATA = "--mock-data --tokenizer-type NullTokenizer --vocab-size 1000"


def _otlp_receiver():
    """Reuse the telemetry benchmark's dropping receiver (127.0.0.1, ephemeral port): (port, stop)."""
    from bench_telemetry import _otlp_receiver as receiver

    return receiver()


def run_once(args, telemetry: bool, port: int):
    """One soak run; returns {pipeline rank: SOAK record} (the lowest rank of each stage)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), SOAK_SAMPLE_EVERY=str(args.sample_every),
               SOAK_WARMUP_ITERS=str(args.warmup), SOAK_TRACEMALLOC="1" if args.tracemalloc else "0")
    env.update(item.split("=", 1) for item in args.env)
    if telemetry:
        env.update(MEGATRON_OTEL_ENABLED="1", MEGATRON_OTEL_SPAN_GROUPS=args.span_groups,
                   OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}", OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.pp),
           str(Path(__file__).resolve().parent / "soak_rank.py"), *args.model.split(),
           "--pipeline-model-parallel-size", str(args.pp), "--train-iters", str(args.iters),
           "--log-interval", str(args.log_interval), "--lr", "1e-4", *args.data.split(), "--eval-iters", "0",
           "--eval-interval", str(args.iters + 1),
           "--distributed-backend", "gloo", "--num-workers", "0", "--seed", "1234"]
    with tempfile.TemporaryDirectory(prefix="soak_") as out:
        env["SOAK_OUT"] = out
        result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
        if result.returncode != 0:
            raise RuntimeError(f"soak run failed (telemetry={telemetry}):\n{result.stdout[-3000:]}\n"
                               f"{result.stderr[-3000:]}")
        records = [json.loads(path.read_text()) for path in Path(out).glob("rank*.json")]
    by_stage = {}
    for record in sorted(records, key=lambda r: r["rank"]):
        by_stage.setdefault(record["pipeline_rank"], record)
    return by_stage


def slope_per_1000(xs, ys) -> float:
    """Least-squares slope of ``ys`` over ``xs`` (iterations), per 1,000 iterations."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 1000.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def summarize(record, warmup: int) -> dict:
    keep = [i for i, it in enumerate(record["iterations"]) if it >= warmup]
    xs = [record["iterations"][i] for i in keep]
    rss = [record["rss_mb"][i] for i in keep]
    objs = [record["gc_objects"][i] for i in keep]
    anon = [record["anon_mb"][i] for i in keep]
    return {"rss_start_mb": rss[0], "rss_end_mb": rss[-1], "rss_mb_per_1k": slope_per_1000(xs, rss),
            "anon_mb_per_1k": slope_per_1000(xs, anon), "anon_end_mb": anon[-1], "file_end_mb": record["file_mb"][-1],
            "objects_per_1k": slope_per_1000(xs, objs), "top_growth": record.get("top_growth", []),
            "iterations": record["iterations"], "rss_mb": record["rss_mb"], "gc_objects": record["gc_objects"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5000, help="iterations per run (default 5000)")
    parser.add_argument("--rounds", type=int, default=1, help="off/on pairs of runs (default 1)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages = ranks (default 2)")
    parser.add_argument("--warmup", type=int, default=500, help="iterations left out of the slope (default 500)")
    parser.add_argument("--sample-every", type=int, default=100, help="iterations between samples (default 100)")
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--span-groups", default="per_step", help="MEGATRON_OTEL_SPAN_GROUPS of the on runs")
    parser.add_argument("--tracemalloc", action="store_true", help="trace Python allocations (every run)")
    parser.add_argument("--model", default=MODEL, help="model/batch flags of pretrain_gpt.py")
    parser.add_argument("--data", default=MOCK_DATA, help="data and tokenizer flags of pretrain_gpt.py (default: "
                        "mock data); e.g. '--data-path PREFIX --split 98,2,0 --tokenizer-type GPT2BPETokenizer "
                        "--vocab-file V --merge-file M' for a preprocessed corpus")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment of the ranks (repeatable), e.g. MALLOC_MMAP_THRESHOLD_=131072")
    parser.add_argument("--timeout", type=int, default=7200, help="seconds per run")
    parser.add_argument("--json", help="also write the summaries to this file")
    args = parser.parse_args()

    port, stop = _otlp_receiver()
    results = {"off": [], "on": []}
    try:
        for round_index in range(args.rounds):
            order = ("off", "on") if round_index % 2 == 0 else ("on", "off")
            for setting in order:
                by_stage = run_once(args, setting == "on", port)
                summary = {stage: summarize(rec, args.warmup) for stage, rec in by_stage.items()}
                results[setting].append(summary)
                for stage, s in sorted(summary.items()):
                    print(f"round {round_index} {setting:3s} stage {stage}: RSS {s['rss_start_mb']:.1f} -> "
                          f"{s['rss_end_mb']:.1f} MB, {s['rss_mb_per_1k']:+.2f} MB/1k it (anonymous "
                          f"{s['anon_mb_per_1k']:+.2f}; at the end {s['anon_end_mb']:.1f} anonymous, "
                          f"{s['file_end_mb']:.1f} file-backed), "
                          f"{s['objects_per_1k']:+.1f} GC objects/1k it", flush=True)
                    for size_kb, count, where in s["top_growth"][:8]:
                        print(f"    {size_kb:+9.1f} KiB {count:+7d} blocks  {where}", flush=True)
    finally:
        stop()
    print(f"\nsoak: {args.iters} iterations, PP={args.pp}, slope after {args.warmup} (MB RSS per 1,000 iterations)")
    print("| stage | off | on | on - off |")
    print("|---|---|---|---|")
    stages = sorted({stage for runs in results.values() for run in runs for stage in run})
    for stage in stages:
        off = [run[stage]["rss_mb_per_1k"] for run in results["off"] if stage in run]
        on = [run[stage]["rss_mb_per_1k"] for run in results["on"] if stage in run]
        fmt = lambda v: ", ".join(f"{x:+.2f}" for x in v)  # noqa: E731
        print(f"| {stage} | {fmt(off)} | {fmt(on)} | {statistics.fmean(on) - statistics.fmean(off):+.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
