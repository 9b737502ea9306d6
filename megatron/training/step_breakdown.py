"""Per-rank step-time breakdown, straggler view and memory at each log interval, with ONE small collective.

Every ``--log-interval`` each rank contributes one row ``[exports?, parts (ms/iteration), other, total,
memory, GPU power/temperature/utilisation/clock, its tensor/pipeline/data-parallel and node-local
rank]`` to an ``all_gather`` over the default group (a few hundred bytes per rank). From the gathered
table:

- each rank's parts go out as ``megatron.training.step.<part>_ms`` gauges (a rank that exports sends
  its own row; the lowest exporting rank also sends the rows of ranks that do not export, so under
  ``single_rank`` every rank's breakdown still reaches the backend exactly once). Every row is labelled
  with ITS rank's coordinates (``dl.rank``, ``dl.tensor_parallel.rank``, ``dl.pipeline_parallel.rank``,
  ``dl.data_parallel.rank``, ``dl.context_parallel.rank``, ``dl.local_rank``, ``service.instance.id``) as
  data-point attributes, which
  take precedence over the exporting rank's resource labels of the same names (Prometheus pull
  endpoint), so a relayed row never carries its sender's place in the layout;
- the straggler view per pipeline stage (the ranks of one stage do the same work; different stages
  do not, so comparing across stages measures the partition, not a straggler): slowest/fastest rank's
  compute time (forward + backward compute) within the stage, the gap between them and their ratio
  (not below ``STRAGGLER_RATIO_FLOOR_MS`` of compute), labelled with ``dl.pipeline_parallel.rank`` only
  (a stage-level series names no rank); and memory per rank (``megatron.training.memory.{allocated,reserved,
  peak}_gb`` on CUDA, ``rss_gb`` always); both sent by the lowest exporting rank;
- with ``--log-straggler`` rank 0 prints Megatron's straggler line
  (``MnRtt/Rnk: 3453.08ms/8 | MxRtt/Rnk: ...``: round-trip = compute time, ``DRtt`` = data wait,
  ``Etpt`` = estimated TFLOP/s from the iteration's FLOPs over the compute time), over all ranks as
  Megatron prints it.

Active when ``--log-straggler`` is given or telemetry metrics are enabled: both are the same on every
rank, so every rank joins the collective (never gated on "this rank exports", spec section 7).
"""
import math
import os
from datetime import datetime
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state, progress, step_timing
from megatron.core.collective_device import get_collective_device
from megatron.core.console import write_line
from megatron.core.step_timing import PARTS, StepTimeRecorder
from megatron.core.telemetry import is_span_group_enabled, managed_span, record_training_metrics
from megatron.core.telemetry.config import DEFAULT_STRAGGLER_RATIO_FLOOR_MS
from megatron.core.telemetry.resources.identity import service_instance_id
from megatron.core.telemetry.strategies import node_local_rank

__all__ = ["StepBreakdown", "TimedDataIterator", "wrap_data_iterator", "memory_stats_gb", "straggler_line",
           "straggler_rank_lines", "stage_stragglers", "row_attributes", "layout_coordinates", "COLUMNS",
           "STRAGGLER_RATIO_FLOOR_MS"]

# Row layout of the gathered table.
COLUMNS = ("exports", *PARTS, "other", "total", "allocated_gb", "reserved_gb", "peak_gb", "rss_gb",
           "power_w", "temperature_c", "utilization_pct", "clock_mhz",
           "tensor_parallel_rank", "pipeline_parallel_rank", "data_parallel_rank", "context_parallel_rank",
           "local_rank")
_COL = {name: index for index, name in enumerate(COLUMNS)}
COMPUTE_PARTS = ("forward_compute", "backward_compute")
# Where a row's rank sits: (data-point attribute, column).
_COORDINATES = (("dl.tensor_parallel.rank", "tensor_parallel_rank"),
                ("dl.pipeline_parallel.rank", "pipeline_parallel_rank"),
                ("dl.data_parallel.rank", "data_parallel_rank"), ("dl.context_parallel.rank", "context_parallel_rank"),
                ("dl.local_rank", "local_rank"))
# Below this much compute per iteration (ms, the stage's fastest rank) the stage straggler ratio is not
# reported: timing jitter of a few ms makes it noise (the gap in ms is reported always). The default of
# MEGATRON_OTEL_STRAGGLER_RATIO_FLOOR_MS (TelemetryConfig.straggler_ratio_floor_ms).
STRAGGLER_RATIO_FLOOR_MS = DEFAULT_STRAGGLER_RATIO_FLOOR_MS
# torch >= 2.13 renamed the flat all-gather; keep working on older releases.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _rss_gb() -> float:
    """Resident set size of this process in GB (Linux /proc; else the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is in KiB on Linux


def memory_stats_gb() -> Dict[str, float]:
    """This rank's memory in GB: ``rss_gb`` always; ``allocated_gb``, ``reserved_gb``, ``peak_gb``
    (``torch.cuda`` caching allocator, current device) only when CUDA is initialised."""
    stats = {"rss_gb": _rss_gb()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats["allocated_gb"] = torch.cuda.memory_allocated() / 1e9
        stats["reserved_gb"] = torch.cuda.memory_reserved() / 1e9
        stats["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return stats


def _gpu_health() -> Dict[str, float]:
    """Power (W), temperature (C), utilisation (%), SM clock (MHz) of the current GPU, through
    ``torch.cuda``'s NVML queries; empty without CUDA or NVML."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    values = {}
    for key, query, scale in (("power_w", "power_draw", 1e-3), ("temperature_c", "temperature", 1.0),
                              ("utilization_pct", "utilization", 1.0), ("clock_mhz", "clock_rate", 1.0)):
        try:
            values[key] = float(getattr(torch.cuda, query)()) * scale  # power_draw is in mW
        except Exception:  # no pynvml, or a query the driver refuses: leave the field out
            pass
    return values


class TimedDataIterator:
    """Wraps a data iterator: each ``next()`` is the ``data_wait`` part of the step and, when the
    ``data_loading`` span group is on, a ``megatron.data_loading`` span."""

    def __init__(self, iterator):
        self.iterator = iterator

    def __iter__(self):
        return self

    def __next__(self):
        state = progress.PROGRESS  # the hang report's phase: "data" while the batch is fetched
        phase, state.phase = state.phase, "data"
        try:
            with step_timing.section("data_wait"):
                if not is_span_group_enabled("data_loading"):
                    return next(self.iterator)
                with managed_span("data_loading", "megatron.data_loading"):
                    return next(self.iterator)
        finally:
            state.phase = phase


def wrap_data_iterator(iterator):
    """``TimedDataIterator`` around ``iterator`` (each element of a list, one per model chunk);
    None stays None."""
    if iterator is None or isinstance(iterator, TimedDataIterator):
        return iterator
    if isinstance(iterator, list):
        return [wrap_data_iterator(item) for item in iterator]
    return TimedDataIterator(iterator)


def _fmt(value: float, unit: str, rank: int) -> str:
    return f"{value:.2f}{unit}/{rank}"


def straggler_line(table: torch.Tensor, flops_per_rank: Optional[float], now: Optional[str] = None) -> str:
    """Megatron's ``--log-straggler`` line from the gathered ``[world, len(COLUMNS)]`` table.

    Fields ``Mn``/``Mx`` + metric + ``/Rnk``: ``Rtt`` round-trip (compute) ms, ``Pwr`` W, ``Tmp`` C,
    ``Utl`` %, ``Clk`` MHz (GPU fields only where measured), ``DRtt`` data wait ms, ``Etpt`` estimated
    TFLOP/s (with ``flops_per_rank``, the FLOPs one rank does per iteration).
    """
    now = now or datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    compute = table[:, _COL["forward_compute"]] + table[:, _COL["backward_compute"]]
    fields = []

    def minmax(name, column, unit):
        finite = torch.isfinite(column)
        if not bool(finite.any()):
            return
        masked_min = torch.where(finite, column, torch.full_like(column, math.inf))
        masked_max = torch.where(finite, column, torch.full_like(column, -math.inf))
        lo, hi = int(torch.argmin(masked_min)), int(torch.argmax(masked_max))
        fields.append(f"Mn{name}/Rnk: {_fmt(float(column[lo]), unit, lo)}")
        fields.append(f"Mx{name}/Rnk: {_fmt(float(column[hi]), unit, hi)}")

    minmax("Rtt", compute, "ms")
    minmax("Pwr", table[:, _COL["power_w"]], "W")
    minmax("Tmp", table[:, _COL["temperature_c"]], "C")
    minmax("Utl", table[:, _COL["utilization_pct"]], "%")
    minmax("Clk", table[:, _COL["clock_mhz"]], "MHz")
    minmax("DRtt", table[:, _COL["data_wait"]], "ms")
    if flops_per_rank:
        etpt = flops_per_rank / (compute.clamp(min=1e-6) / 1000.0) / 1e12
        minmax("Etpt", etpt, "TF")
    return f"[{now}] | " + " | ".join(fields)


def straggler_rank_lines(table: torch.Tensor, flops_per_rank: Optional[float], count: int) -> List[str]:
    """``--straggler-minmax-count`` N > 1 (and below the world size): Megatron's two extra lines,
    the N lowest and N highest estimated TFLOP/s as ``value/rank``, each list in ascending order."""
    world = table.shape[0]
    if not flops_per_rank or count <= 1 or count >= world:
        return []
    compute = table[:, _COL["forward_compute"]] + table[:, _COL["backward_compute"]]
    etpt = flops_per_rank / (compute.clamp(min=1e-6) / 1000.0) / 1e12
    order = sorted(range(world), key=lambda r: (float(etpt[r]), r))
    pairs = [f" {float(etpt[r]):.2f}/{r}," for r in order]
    return [f"^^^^ Bottom {count} Ranks with lowest  Etpt(TF):" + "".join(pairs[:count]),
            f"^^^^ Top    {count} Ranks with highest Etpt(TF):" + "".join(pairs[world - count:])]


def layout_coordinates(rank: int) -> List[float]:
    """This rank's ``[tensor_parallel_rank, pipeline_parallel_rank, data_parallel_rank, context_parallel_rank,
    local_rank]`` (``parallel_state``; before it is initialised: ``[0, 0, rank, 0, local]``)."""
    if parallel_state.model_parallel_is_initialized():
        coords = [parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
                  parallel_state.get_data_parallel_rank(), parallel_state.get_context_parallel_rank()]
    else:
        coords = [0, 0, rank, 0]
    try:
        local = node_local_rank()
    except ValueError:  # a malformed LOCAL_RANK is reported where telemetry starts, not here
        local = math.nan
    return [float(c) for c in coords] + [float(local)]


def row_attributes(row: torch.Tensor, rank: int, run_id: Optional[str] = None) -> Dict[str, object]:
    """Data-point attributes of ``rank``'s row of the gathered table: ``dl.rank``, its parallel and
    node-local ranks (where known) and, with ``run_id``, its ``service.instance.id``."""
    attrs: Dict[str, object] = {"dl.rank": rank}
    for key, column in _COORDINATES:
        value = float(row[_COL[column]])
        if math.isfinite(value):
            attrs[key] = int(value)
    if run_id:
        attrs["service.instance.id"] = service_instance_id(run_id, rank)
    return attrs


def stage_stragglers(table: torch.Tensor,
                     ratio_floor_ms: float = STRAGGLER_RATIO_FLOOR_MS) -> Dict[int, Dict[str, float]]:
    """Per pipeline stage: the slowest and fastest rank by compute time (forward + backward compute,
    ms per iteration) among the ranks of that stage, the gap between them (ms) and their ratio.

    The ratio is None when the fastest rank computes less than ``ratio_floor_ms`` (a few ms of jitter
    on a stage that computes 13 ms read as a 2x straggler in a healthy run): the gap still shows a
    real straggler there (it is 0 with one rank per stage)."""
    compute = table[:, _COL["forward_compute"]] + table[:, _COL["backward_compute"]]
    stages = table[:, _COL["pipeline_parallel_rank"]].nan_to_num(0.0).long().tolist()
    out = {}
    for stage in sorted(set(stages)):
        members = [r for r, s in enumerate(stages) if s == stage]
        slow = max(members, key=lambda r: (float(compute[r]), -r))
        fast = min(members, key=lambda r: (float(compute[r]), r))
        slowest, fastest = float(compute[slow]), float(compute[fast])
        out[stage] = {"straggler_slowest_compute_ms": slowest, "straggler_fastest_compute_ms": fastest,
                      "straggler_gap_ms": slowest - fastest,
                      "straggler_ratio": slowest / fastest if fastest >= ratio_floor_ms and fastest > 0 else None,
                      "straggler_slowest_rank": slow, "straggler_fastest_rank": fast}
    return out


class StepBreakdown:
    """The step-time recorder of one training run and its per-log-interval report.

    Use: ``create(logger, handle)`` (``logger``: the run's LoggerConfig; None when neither
    ``--log-straggler`` nor telemetry metrics are on),
    ``step_begin()``/``step_end()`` around each iteration, ``report(flops_per_rank)`` on every log
    iteration (collective: every rank calls it), ``close()`` at the end.
    """

    def __init__(self, rank: int, world_size: int, exporting_meter, log_straggler: bool,
                 recorder: Optional[StepTimeRecorder] = None, minmax_count: int = 1, run_id: Optional[str] = None,
                 ratio_floor_ms: float = STRAGGLER_RATIO_FLOOR_MS):
        self.rank, self.world_size = rank, world_size
        self.meter = exporting_meter
        self.log_straggler = log_straggler
        self.minmax_count = minmax_count
        self.run_id = run_id
        self.ratio_floor_ms = float(ratio_floor_ms)
        self.recorder = recorder or StepTimeRecorder()
        self.last_table: Optional[torch.Tensor] = None
        self._coordinates = layout_coordinates(rank)
        step_timing.install(self.recorder)

    @classmethod
    def create(cls, logger, handle) -> Optional["StepBreakdown"]:
        """The recorder for ``logger`` (LoggerConfig: ``log_straggler``, ``straggler_minmax_count``) and
        the telemetry ``handle``, or None when there is nothing to record."""
        log_straggler = bool(logger.log_straggler)
        metrics_on = handle is not None and handle.config.enabled and handle.config.metrics_enabled
        if not (log_straggler or metrics_on):
            return None
        meter = handle.meter if handle is not None and handle.is_exporting else None
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        floor = getattr(getattr(handle, "config", None), "straggler_ratio_floor_ms", STRAGGLER_RATIO_FLOOR_MS)
        return cls(rank, world, meter, log_straggler, minmax_count=int(logger.straggler_minmax_count or 1),
                   run_id=getattr(handle, "run_id", None), ratio_floor_ms=floor)

    def step_begin(self) -> None:
        self.recorder.step_begin()

    def step_end(self) -> None:
        self.recorder.step_end()

    def close(self) -> None:
        if step_timing.active_recorder() is self.recorder:
            step_timing.uninstall()

    def _local_row(self) -> List[float]:
        parts = self.recorder.take()
        memory = memory_stats_gb()
        health = _gpu_health()
        row = [1.0 if self.meter is not None else 0.0]
        row += [parts[part] for part in PARTS] + [parts["other"], parts["total"]]
        row += [memory.get(key, math.nan) for key in ("allocated_gb", "reserved_gb", "peak_gb", "rss_gb")]
        row += [health.get(key, math.nan) for key in ("power_w", "temperature_c", "utilization_pct", "clock_mhz")]
        row += self._coordinates
        return row

    def gather(self) -> torch.Tensor:
        """All ranks' rows, ``[world, len(COLUMNS)]`` float64 on the CPU; one ``all_gather``."""
        local = torch.tensor(self._local_row(), dtype=torch.float64)
        if not dist.is_initialized() or self.world_size == 1:
            return local.unsqueeze(0)
        device = get_collective_device()
        out = torch.empty(self.world_size * len(COLUMNS), dtype=torch.float64, device=device)
        _all_gather_flat(out, local.to(device))
        return out.view(self.world_size, len(COLUMNS)).cpu()

    def report(self, flops_per_rank: Optional[float] = None) -> torch.Tensor:
        """Collective: gather the rows, record the metrics (exporting ranks), print the straggler
        line (``--log-straggler``, rank 0). Returns the table."""
        table = self.gather()
        self.last_table = table
        if self.meter is not None:
            self._record(table)
        if self.log_straggler and self.rank == 0:
            write_line(straggler_line(table, flops_per_rank))
            for line in straggler_rank_lines(table, flops_per_rank, self.minmax_count):
                write_line(line)
        return table

    def _record(self, table: torch.Tensor) -> None:
        exporters = [r for r in range(table.shape[0]) if table[r, _COL["exports"]] > 0]
        lead = bool(exporters) and exporters[0] == self.rank
        ranks = [r for r in range(table.shape[0]) if r == self.rank or (lead and table[r, _COL["exports"]] == 0)]
        for r in ranks:
            row = table[r]
            attrs = row_attributes(row, r, self.run_id)
            parts = {f"step_{name}_ms": float(row[_COL[name]]) for name in (*PARTS, "other", "total")}
            record_training_metrics(self.meter, attributes=attrs, **parts)
            memory = {f"rank_memory_{key}": float(row[_COL[key]])
                      for key in ("allocated_gb", "reserved_gb", "peak_gb", "rss_gb")
                      if math.isfinite(float(row[_COL[key]]))}
            record_training_metrics(self.meter, attributes=attrs, **memory)
        if lead:
            for stage, values in stage_stragglers(table, self.ratio_floor_ms).items():
                record_training_metrics(self.meter, attributes={"dl.pipeline_parallel.rank": stage}, **values)
