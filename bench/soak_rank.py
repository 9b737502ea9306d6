"""In-rank harness of the soak benchmark: samples this rank's memory every N iterations of a long pretrain_gpt.py run.

Run as a torchrun rank by ``bench_soak.py`` (``python bench/soak_rank.py <pretrain_gpt.py flags>``).
Every ``SOAK_SAMPLE_EVERY`` iterations (default 100) it records, after the iteration's ``training_log``:
the resident set size (``/proc/self/statm``, MB) and its anonymous and file-backed parts, the number of objects the garbage collector tracks
(``gc.get_objects()``: a Python-level leak grows it; a native one does not) and, with
``SOAK_TRACEMALLOC=1``, the bytes tracemalloc sees allocated by Python code.

With ``SOAK_TRACEMALLOC=1`` tracing starts after the first ``SOAK_WARMUP_ITERS`` iterations (default
500: caches, the allocator and the exporters have settled) and at the end the rank reports the 12
source lines whose live allocations grew most between the two snapshots (``Snapshot.compare_to``,
grouped by line, this project's and the libraries' frames alike).

At exit the rank writes ``$SOAK_OUT/rank<R>.json`` (the ranks share stdout, where lines interleave):
``rank``, ``pipeline_rank``, ``iterations``,
``rss_mb``, ``anon_mb``, ``file_mb``, ``gc_objects``, ``traced_mb`` (lists, one entry per sample) and ``top_growth`` (list of
``[size_diff_kb, count_diff, "file:line"]``).
"""
from __future__ import annotations

import gc
import json
import os
import sys
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from telemetry_toggle import run_pretrain_gpt  # noqa: E402

def rss_mb() -> float:
    """Resident set size of this process in MB (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def rss_parts_mb() -> dict:
    """``RssAnon`` (heap, stacks: what a leak grows) and ``RssFile`` (mapped files, e.g. the dataset's
    memory-mapped ``.bin``/``.npy`` pages, which the kernel may drop) of ``/proc/self/status``, MB."""
    parts = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                parts[key] = int(value.split()[0]) / 1e3  # kB
    return parts


def main(argv) -> None:
    import megatron.training.training as training
    from megatron.core import parallel_state

    every = int(os.environ.get("SOAK_SAMPLE_EVERY", "100"))
    warmup = int(os.environ.get("SOAK_WARMUP_ITERS", "500"))
    trace = os.environ.get("SOAK_TRACEMALLOC", "0") == "1"
    record = {"iterations": [], "rss_mb": [], "anon_mb": [], "file_mb": [], "gc_objects": [], "traced_mb": [],
              "top_growth": []}
    snapshots = {}
    inner = training.training_log

    def sampled_training_log(*args, **kwargs):
        result = inner(*args, **kwargs)
        iteration = args[4]
        if "pipeline_rank" not in record:
            record["pipeline_rank"] = parallel_state.get_pipeline_model_parallel_rank()
        if trace and iteration == warmup:
            tracemalloc.start(8)
            snapshots["start"] = tracemalloc.take_snapshot()
        if iteration % every == 0:
            record["iterations"].append(iteration)
            record["rss_mb"].append(rss_mb())
            parts = rss_parts_mb()
            record["anon_mb"].append(parts.get("RssAnon", float("nan")))
            record["file_mb"].append(parts.get("RssFile", float("nan")))
            record["gc_objects"].append(len(gc.get_objects()))
            record["traced_mb"].append(tracemalloc.get_traced_memory()[0] / 1e6 if tracemalloc.is_tracing() else 0.0)
        return result

    def report():
        if trace and "start" in snapshots and tracemalloc.is_tracing():
            end = tracemalloc.take_snapshot()
            ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
            diff = end.filter_traces(ignore).compare_to(snapshots["start"].filter_traces(ignore), "lineno")
            record["top_growth"] = [[round(d.size_diff / 1024, 1), d.count_diff, str(d.traceback[0])]
                                    for d in diff[:12]]
        record["rank"] = int(os.environ.get("RANK", "0"))
        Path(os.environ["SOAK_OUT"], f"rank{record['rank']}.json").write_text(json.dumps(record))

    run_pretrain_gpt(argv, sampled_training_log, report)


if __name__ == "__main__":
    main(sys.argv[1:])
