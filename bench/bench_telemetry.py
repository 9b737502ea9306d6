"""Benchmark: nanoseconds per call of disabled/enabled ``managed_span`` blocks and ``is_span_group_enabled``.

Run ``python bench/bench_telemetry.py [--calls N] [--repeats R]``. Prints plain numbers (best of R
repeats, ns per call) and the ratio to an empty ``with nullcontext()`` block measured the same way.
Target (spec section 4): a disabled ``managed_span`` block costs at most 300 ns.
"""
from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000, help="calls per timing repeat (disabled paths)")
    parser.add_argument("--enabled-calls", type=int, default=5_000, help="calls per repeat (enabled path)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

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
