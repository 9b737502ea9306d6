"""Troubleshooting built into the run: the hang monitor's start and stop, slow-step lines, their span events and counters.

- ``start_hang_monitor(cfg)`` / ``stop_hang_monitor()``: one :class:`megatron.core.hang_monitor.HangMonitor`
  per rank for ``--hang-report-seconds`` > 0; its reports go out as the ``megatron.hang_report`` span event
  and the ``megatron.training.hang_reports`` counter (exporting ranks).
- :class:`SlowStepDetector`: a step slower than ``--slow-step-factor`` times the running median step time
  gives one line on rank 0, ``iteration 812 took 3.4x the median: data wait +2.10 s on rank 5``, and the
  ``megatron.slow_step`` span event (lowest exporting rank) and ``megatron.training.slow_steps`` counter.
  The part and the rank come from the per-rank step breakdown (``step_breakdown.StepBreakdown``, gathered
  at each log iteration when ``--log-straggler`` or telemetry metrics are on), so the line is printed at
  the log iteration that closes the slow step's interval. The breakdown is an interval average: at
  ``--log-interval 1`` the delta is the slow step's own; above 1 it is the part's extra time over the
  interval (the line names the interval), which is the slow step's when it is the interval's only slow one.
"""
import os
import statistics
from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.console import write_line
from megatron.core.hang_monitor import HangMonitor, HangReport
from megatron.core.step_timing import PARTS
from megatron.core.telemetry import record_training_metrics, span_cm
from megatron.training.global_vars import get_telemetry
from megatron.training.step_breakdown import COLUMNS

__all__ = ["start_hang_monitor", "stop_hang_monitor", "active_hang_monitor", "SlowStepDetector", "slow_step_line",
           "explain_slow_interval", "emit_event"]

_MONITOR: Optional[HangMonitor] = None
_COL = {name: index for index, name in enumerate(COLUMNS)}
# Parts in which a rank waits for another (their growth is usually an effect of a slow peer).
_WAITING_PARTS = ("tp_comm", "pp_comm", "cp_comm", "ep_comm", "grad_sync")
_OWN_PARTS = tuple(p for p in PARTS if p not in _WAITING_PARTS) + ("other",)


def emit_event(name: str, attributes: Dict[str, object], counter: Optional[str] = None, flush: bool = False) -> None:
    """A short span ``name`` holding one span event ``name`` with ``attributes`` (and the same span
    attributes), plus one on ``counter`` (a ``record_training_metrics`` keyword) and a metric snapshot;
    on exporting ranks only (a no-op elsewhere). ``flush``: export now (a hung job may be killed next)."""
    handle = get_telemetry()
    if handle is None or not handle.is_exporting:
        return
    if handle.config.traces_enabled:
        with span_cm(name, **attributes) as span:
            if span is not None and hasattr(span, "add_event"):
                span.add_event(name, attributes=dict(attributes))
    if counter is not None and handle.config.metrics_enabled:
        record_training_metrics(handle.meter, **{counter: 1})
        handle.snapshot_metrics()
    if flush:
        handle.force_flush(timeout_ms=2000)


def _on_hang_report(report: HangReport) -> None:
    emit_event("megatron.hang_report", {"megatron.iteration": int(report.iteration),
                                        "megatron.hang.stalled_ranks": [int(r) for r in report.stalled_ranks],
                                        "megatron.hang.phase": str(report.phase),
                                        "megatron.hang.seconds": float(report.seconds)},
               counter="hang_reports", flush=True)


def start_hang_monitor(cfg) -> Optional[HangMonitor]:
    """Start this rank's hang monitor for ``cfg.logger.hang_report_seconds`` > 0 (after the process group
    exists); the stack files go to ``--save``, else ``--tensorboard-dir``, else the working directory.
    Returns the monitor (None when off or without a process group of more than one rank)."""
    global _MONITOR
    seconds = cfg.logger.hang_report_seconds
    if not seconds or not dist.is_initialized() or dist.get_world_size() < 2 or _MONITOR is not None:
        return None
    report_dir = cfg.checkpoint.save or cfg.logger.tensorboard_dir or os.getcwd()
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    _MONITOR = HangMonitor(dist.get_rank(), dist.get_world_size(), seconds, report_dir=report_dir,
                           on_report=_on_hang_report, store_host_rank=None if agent_store else 0).start()
    return _MONITOR


def stop_hang_monitor() -> None:
    """Stop the monitor (before the process group and its store go away, so no rank mistakes the end of
    the run for a stalled store)."""
    global _MONITOR
    if _MONITOR is not None:
        _MONITOR.stop()
        _MONITOR = None


def active_hang_monitor() -> Optional[HangMonitor]:
    return _MONITOR


def slow_step_line(iteration: int, ratio: float, part: Optional[str], delta_s: float, rank: Optional[int],
                   interval: Optional[Tuple[int, int]] = None, slow_steps: int = 1, hint: bool = False) -> str:
    """``iteration 812 took 3.4x the median: data wait +2.10 s on rank 5``; with an ``interval`` of several
    iterations, ``... over iterations 801-900 ...``; without a part, the step's own excess and, with
    ``hint`` (no breakdown gathered), which flags name the part."""
    text = f"iteration {iteration} took {ratio:.1f}x the median"
    if part is None:
        text += f": +{delta_s:.2f} s"
        text += (" (--log-straggler or telemetry metrics name the part of the step and the rank)" if hint
                 else " (no part of the step breakdown grew)")
        return text
    text += f": {part.replace('_', ' ')} {'+' if delta_s >= 0 else ''}{delta_s:.2f} s on rank {rank}"
    if interval is not None and interval[1] > interval[0]:
        more = f", {slow_steps} slow steps" if slow_steps > 1 else ""
        text += f" (breakdown over iterations {interval[0]}-{interval[1]}{more})"
    return text


def explain_slow_interval(table: torch.Tensor, baseline: Optional[torch.Tensor], steps: int,
                          step_excess_s: float) -> Tuple[Optional[str], Optional[int], float]:
    """Which part of which rank grew: ``(part, rank, delta seconds)``; ``(None, None, step_excess_s)`` when
    no part grew.

    ``table``: the gathered ``[world, len(COLUMNS)]`` breakdown (ms per iteration, averaged over the
    interval's ``steps`` iterations); ``baseline``: the same shape, each rank's typical values (median of
    earlier intervals), or None (then each part is compared with its median over the ranks). The excess
    of a part over the interval is ``(value - baseline) * steps``. A rank's own parts (compute, data
    wait, optimizer, other) come first: a communication part grows on the ranks that wait for a slow
    peer, so it is named only when no own part explains a quarter of the step's excess
    (``step_excess_s``)."""
    def excess(parts):
        columns = [_COL[p] for p in parts]
        values = table[:, columns]
        base = baseline[:, columns] if baseline is not None else values.median(dim=0).values.expand_as(values)
        grown = (values - base) * steps / 1000.0
        flat = int(torch.argmax(grown))
        rank, index = divmod(flat, len(parts))
        return parts[index], rank, float(grown[rank, index])

    part, rank, delta = excess(_OWN_PARTS)
    if delta < 0.25 * step_excess_s:
        other = excess(_WAITING_PARTS)
        if other[2] > delta:
            part, rank, delta = other
    if delta <= 0:  # nothing grew (one rank and no earlier interval to compare with)
        return None, None, step_excess_s
    return part, rank, delta


# A slow step must also be this many seconds over the median: a 10 ms CPU step that takes 30 ms is noise.
MIN_SLOW_STEP_EXCESS_S = 0.25


class SlowStepDetector:
    """Judges each step's wall time (seconds, this rank's) against the running median.

    Args:
        factor: ``--slow-step-factor`` (> 1).
        warmup: steps of this run never judged nor counted in the median (the first iterations compile,
            allocate and warm caches).
        window: steps in the running median.
        min_history: steps needed in the window before a step is judged.
        min_excess_s: seconds a step must exceed the median by to count (tiny steps on a busy host jitter by
            several times their length without anything worth a line).
    """

    def __init__(self, factor: float, rank: int, warmup: int = 2, window: int = 50, min_history: int = 4,
                 min_excess_s: float = MIN_SLOW_STEP_EXCESS_S):
        self.factor, self.rank, self.min_excess_s = float(factor), rank, float(min_excess_s)
        self.warmup, self.min_history = warmup, min_history
        self._history: Deque[float] = deque(maxlen=window)
        self._seen = 0
        self._pending: List[Tuple[int, float, float]] = []  # (iteration, seconds, median) since the last report
        self._tables: Deque[torch.Tensor] = deque(maxlen=20)  # breakdowns of intervals without a slow step
        self.lines: List[str] = []

    def step(self, iteration: int, seconds: float) -> None:
        """Record iteration ``iteration``'s wall time."""
        self._seen += 1
        if self._seen <= self.warmup:
            return
        if len(self._history) >= self.min_history:
            median = statistics.median(self._history)
            if median > 0 and seconds > self.factor * median and seconds - median >= self.min_excess_s:
                self._pending.append((iteration, seconds, median))
        self._history.append(seconds)

    def report(self, table: Optional[torch.Tensor], first_iteration: int, last_iteration: int) -> List[str]:
        """At a log iteration (every rank, same iterations): the lines of the slow steps since the last
        one, printed on rank 0, and their span events (the lowest exporting rank, from ``table``'s
        ``exports`` column; without a table, every exporting rank that judged the step slow). ``table``:
        the interval's gathered breakdown, or None when none is gathered. Returns the lines."""
        pending, self._pending = self._pending, []
        if table is None:
            lines = []
            for iteration, seconds, median in pending:
                lines.append(self._publish(iteration, seconds / median, None, seconds - median, None, None, 1,
                                           lead=True, hint=True))
            return lines
        if not pending:
            if self._seen > self.warmup:  # the warm-up steps' breakdown is no baseline
                self._tables.append(table.clone())
            return []
        exporters = [r for r in range(table.shape[0]) if table[r, _COL["exports"]] > 0]
        lead = bool(exporters) and exporters[0] == self.rank
        baseline = torch.stack(list(self._tables)).median(dim=0).values if self._tables else None
        steps = max(last_iteration - first_iteration + 1, 1)
        iteration, seconds, median = max(pending, key=lambda p: p[1] / p[2])
        step_excess = sum(s - m for _, s, m in pending)
        part, rank, delta = explain_slow_interval(table, baseline, steps, step_excess)
        return [self._publish(iteration, seconds / median, part, delta, rank, (first_iteration, last_iteration),
                              len(pending), lead)]

    def _publish(self, iteration, ratio, part, delta_s, rank, interval, count, lead, hint=False) -> str:
        line = slow_step_line(iteration, ratio, part, delta_s, rank, interval, count, hint=hint)
        self.lines.append(line)
        if self.rank == 0:
            write_line(line)
        if lead:
            emit_event("megatron.slow_step", {"megatron.iteration": int(iteration),
                                              "megatron.slow_step.ratio": float(ratio),
                                              "megatron.slow_step.part": part or "unknown",
                                              "megatron.slow_step.delta_ms": float(delta_s) * 1000.0,
                                              "megatron.slow_step.rank": -1 if rank is None else int(rank)},
                       counter="slow_steps")
        return line
