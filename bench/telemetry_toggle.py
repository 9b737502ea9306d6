"""In-rank harness of the paired telemetry benchmark: switches telemetry's per-step work off and on, iteration by iteration.

Run as a torchrun rank by ``bench_telemetry.py --training`` (``python bench/telemetry_toggle.py
<pretrain_gpt.py flags>``), with telemetry enabled through the environment and an odd ``--log-interval``
L. Why pairs inside one run: whole runs of one configuration differ by up to 10 % on a shared machine
(memory layout, the neighbours' load of that minute), and single iterations by 10 %, but two adjacent
iterations of one run differ far less, so the on/off difference is measured between neighbours.

After ``BENCH_WARMUP_INTERVALS`` log intervals with telemetry on, every iteration runs either with
telemetry on or off:

* the L - 1 iterations between log iterations form (L - 1) / 2 pairs of neighbours, one on and one
  off, in the order on/off, off/on, on/off, ... over the run, so that neither side is always first;
* log iterations (metric recording, snapshot and export, the step-breakdown gather) are paired with
  the next log iteration, alternating in the same way.

"Off" turns off everything telemetry does per step: no span group is enabled (every span helper is the
shared no-op), ``get_telemetry()`` reads None where the training loop records metrics, and the step
breakdown (recorder, per-interval gather and metrics) does nothing, exactly as when
``StepBreakdown.create`` returns None with ``MEGATRON_OTEL_ENABLED=0``. What stays is what a run pays
once (the SDK imports, idle exporter threads), which is not step time. With telemetry disabled there
is nothing to switch: the pairs then measure the harness's own bias (an A/A control).

Per iteration the harness takes, from the end of the previous ``training_log`` call to the end of its
own: the wall time and the CPU time of the training thread. The export work that spans and metrics
cause runs on the exporter threads at their own moments; it is measured as a whole: the process's CPU
time over the measured iterations (exporters flushed at both ends) minus the training thread's CPU in
the iteration windows (``extra_cpu_ms``, charged to the on iterations by the benchmark).

At exit the rank prints one line ``BENCH_PAIRED <json>`` with, for the non-log pairs and the log pairs
(index i = pair i), ``{nonlog,log}_{on,off}_{wall,cpu}_ms`` and ``extra_cpu_ms``, ``on_iterations``,
``off_iterations``, ``log_interval``.
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PREFIX = "BENCH_PAIRED"


class TelemetrySwitch:
    """Turns the per-step telemetry of this rank off and on between training iterations."""

    def __init__(self):
        from megatron.core import step_timing
        from megatron.core.telemetry import state
        from megatron.training import global_vars, step_breakdown, telemetry_hooks, training_log

        self._state, self._step_timing = state, step_timing
        self._groups = state.get_enabled_groups()
        self._recorder = None
        self.on = True
        switch = self

        def get_telemetry():
            return global_vars.get_telemetry() if switch.on else None

        # The two modules that look the handle up once per iteration or log interval.
        telemetry_hooks.get_telemetry = get_telemetry
        training_log.get_telemetry = get_telemetry
        breakdown = step_breakdown.StepBreakdown
        for name in ("step_begin", "step_end", "report"):
            method = getattr(breakdown, name)

            def gated(self, *args, _method=method, **kwargs):
                return _method(self, *args, **kwargs) if switch.on else None

            setattr(breakdown, name, gated)

    def set(self, on: bool) -> None:
        if on == self.on:
            return
        if not on:
            self._groups = self._state.get_enabled_groups()
            self._recorder = self._step_timing.active_recorder()
            self._state.set_enabled_groups(())
            self._step_timing.uninstall()
        else:
            self._state.set_enabled_groups(self._groups)
            if self._recorder is not None:
                self._step_timing.install(self._recorder)
        self.on = on


def iteration_plan(iteration: int, interval: int, warmup_intervals: int) -> tuple:
    """``(on, kind, pair)`` of 1-based ``iteration``: telemetry on or off, ``"warmup"``, ``"nonlog"`` or
    ``"log"``, and the index of its pair within that kind (pairs alternate which side comes first)."""
    if iteration <= warmup_intervals * interval:
        return True, "warmup", -1
    interval_index, position = divmod(iteration - warmup_intervals * interval - 1, interval)
    if position == interval - 1:
        pair, second = divmod(interval_index, 2)
        return (pair % 2 == 0) != bool(second), "log", pair
    per_interval = (interval - 1) // 2
    local_pair, second = divmod(position, 2)
    pair = interval_index * per_interval + local_pair
    return (pair % 2 == 0) != bool(second), "nonlog", pair


def main(argv) -> None:
    import megatron.training.training as training
    from megatron.core.telemetry.handle import get_active_handle
    from megatron.training.global_vars import get_args

    warmup = int(os.environ.get("BENCH_WARMUP_INTERVALS", "2"))
    state = {"switch": None, "interval": None, "mark": None, "phase_start_cpu": None, "phase_end_cpu": None}
    samples = {}  # (kind, on) -> {pair: (wall ms, cpu ms)}
    window_cpu = [0.0]
    counts = {True: 0, False: 0}
    inner = training.training_log

    def flush():
        handle = get_active_handle()
        if handle is not None:
            handle.force_flush(30_000)

    def timed_training_log(*args, **kwargs):
        result = inner(*args, **kwargs)
        wall, cpu = time.perf_counter(), time.thread_time()
        iteration = args[4]
        if state["interval"] is None:
            interval = get_args().log_interval
            if interval < 3 or interval % 2 == 0:
                raise SystemExit(f"telemetry_toggle.py needs an odd --log-interval >= 3, got {interval}")
            state["interval"] = interval
        interval = state["interval"]
        on, kind, pair = iteration_plan(iteration, interval, warmup)
        if kind != "warmup":
            start_wall, start_cpu = state["mark"]
            samples.setdefault((kind, on), {})[pair] = ((wall - start_wall) * 1e3, (cpu - start_cpu) * 1e3)
            window_cpu[0] += cpu - start_cpu
            counts[on] += 1
        if iteration == warmup * interval:
            flush()  # the warm-up's spans are exported before the measured phase
            state["phase_start_cpu"] = time.process_time()
        if iteration == get_args().train_iters:
            flush()  # the measured iterations' spans and metrics are exported within the phase
            state["phase_end_cpu"] = time.process_time()
        if state["switch"] is None:
            state["switch"] = TelemetrySwitch()
        state["switch"].set(iteration_plan(iteration + 1, interval, warmup)[0])
        state["mark"] = (time.perf_counter(), time.thread_time())
        return result

    def report():
        if state["phase_start_cpu"] is None or state["phase_end_cpu"] is None:
            return
        extra_ms = (state["phase_end_cpu"] - state["phase_start_cpu"] - window_cpu[0]) * 1e3
        out = {"extra_cpu_ms": extra_ms, "on_iterations": counts[True], "off_iterations": counts[False],
               "log_interval": state["interval"]}
        for kind in ("nonlog", "log"):
            on, off = samples.get((kind, True), {}), samples.get((kind, False), {})
            both = sorted(set(on) & set(off))
            for side, values in (("on", on), ("off", off)):
                out[f"{kind}_{side}_wall_ms"] = [values[p][0] for p in both]
                out[f"{kind}_{side}_cpu_ms"] = [values[p][1] for p in both]
        print(f"{PREFIX} " + json.dumps(out), flush=True)

    run_pretrain_gpt(argv, timed_training_log, report)


def run_pretrain_gpt(argv, training_log, at_exit) -> None:
    """Run ``pretrain_gpt.py argv`` in this process with ``training.training_log`` replaced by
    ``training_log`` (which calls the original itself) and ``at_exit`` registered with ``atexit``."""
    import megatron.training.training as training

    training.training_log = training_log
    atexit.register(at_exit)
    sys.argv = [str(REPO / "pretrain_gpt.py"), *argv]
    runpy.run_path(str(REPO / "pretrain_gpt.py"), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
