"""One self-contained HTML page from a run's telemetry: loss, throughput, each rank's step breakdown, stragglers, slow steps, hangs, settings.

Usage::

    python tools/telemetry_report.py RUN_OUTPUT [RUN_OUTPUT ...] -o report.html

``RUN_OUTPUT`` is what the run left: the console telemetry of a run launched with
``MEGATRON_OTEL_ENABLED=1 MEGATRON_OTEL_EXPORTER=console MEGATRON_OTEL_RANK_STRATEGY=all_ranks`` (one JSON
object per line on each rank's stdout, mixed with the log: the redirected output of ``torchrun``, or
torchrun's ``--log-dir`` folder of per-rank files), or an OTLP JSON file (an OpenTelemetry Collector's
``file`` exporter: ``{"resourceSpans": ...}`` / ``{"resourceMetrics": ...}`` lines). A folder is read
recursively (``*.log``, ``*.out``, ``*.err``, ``*.txt``, ``*.json``, ``*.jsonl``; profiler traces skipped).
The page needs no network: the figures are SVG drawn with matplotlib (``pip install -e ".[report]"``)
and embedded; the numbers behind them are in a ``<script type="application/json" id="report-data">``
block and in the tables.

What is read: the metric snapshots each exporting rank sends every ``--log-interval`` (each snapshot's
``megatron.training.iteration`` gauge dates the other points of that snapshot, same resource and
timestamp), the step spans' events ``megatron.slow_step`` and ``megatron.hang_report`` (on whatever span
carries them), the resource attributes (the run's settings per rank) and, when the log is in the input,
Megatron's ``arguments`` block. Loss, elapsed time and throughput are the values of the rank that prints
the log line (the last rank that exports them). The elapsed time per iteration is the
``megatron.training.step_duration_ms`` histogram's new sum over its new count between two snapshots.
"""
import argparse
import html
import io
import json
import os
import re
import sys
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.step_timing import PARTS  # noqa: E402  (the step's parts, in report order)

BREAKDOWN_PARTS = (*PARTS, "other")
_TEXT_SUFFIXES = (".log", ".out", ".err", ".txt", ".json", ".jsonl")
_RUN_METRICS = {  # metric name -> key in the per-iteration rows
    "megatron.training.loss": "loss",
    "megatron.training.tokens_per_sec": "tokens_per_sec",
    "megatron.training.throughput_tflops": "throughput_tflops",
    "megatron.training.learning_rate": "learning_rate",
    "megatron.training.grad_norm": "grad_norm",
}
_ITERATION = "megatron.training.iteration"
_STEP_DURATION = "megatron.training.step_duration_ms"
_STEP_PREFIX, _STRAGGLER_PREFIX = "megatron.training.step.", "megatron.training.straggler."
_MOE_PREFIX = "megatron.training.moe."  # per-expert load of MoE runs (docs/observability.md)
SLOW_STEP_EVENT, HANG_EVENT = "megatron.slow_step", "megatron.hang_report"
SLOW_STEP_COLUMNS = ("megatron.iteration", "megatron.slow_step.rank", "megatron.slow_step.ratio",
                     "megatron.slow_step.part", "megatron.slow_step.delta_ms")
HANG_COLUMNS = ("megatron.iteration", "megatron.hang.stalled_ranks", "megatron.hang.phase", "megatron.hang.seconds")
# Resource attributes that differ per process: shown per rank, not as run settings.
_PER_PROCESS = ("service.instance.id", "host.name", "process.pid", "dl.rank", "dl.local_rank",
                "dl.tensor_parallel.rank", "dl.pipeline_parallel.rank", "dl.data_parallel.rank",
                "dl.context_parallel.rank", "dl.expert_parallel.rank")
_ARGS_START = re.compile(r"^-+ arguments -+\s*$")
_ARGS_END = re.compile(r"^-+ end of arguments -+\s*$")
_ARG_LINE = re.compile(r"^\s+(\S+) \.+ ?(.*)$")


class ReportError(Exception):
    """Bad input: the message is the one line the tool prints (naming the file)."""


# ------------------------------------------------------------------------------------------------ reading
def input_files(paths: Iterable[str]) -> List[str]:
    """The files to read: each path itself, or a folder's text files (recursively, sorted). Raises
    ReportError for a path that does not exist or a folder with no such file."""
    files = []
    for path in paths:
        if os.path.isfile(path):
            files.append(path)
        elif os.path.isdir(path):
            found = sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names
                           if name.endswith(_TEXT_SUFFIXES) and not name.endswith(".pt.trace.json"))
            if not found:
                raise ReportError(f"{path}: the folder holds no {', '.join(_TEXT_SUFFIXES)} file")
            files.extend(found)
        else:
            raise ReportError(f"{path}: no such file or folder")
    return files


def json_objects(text: str) -> Tuple[List[dict], List[str]]:
    """The JSON objects in ``text`` (wherever one starts in a line: an exporter thread's line can land inside
    a log line) and the text lines left once they are cut out."""
    decoder = json.JSONDecoder()
    objects, rest = [], []
    for line in text.splitlines():
        kept, at = [], 0
        start = line.find('{"')
        while start != -1:
            try:
                obj, end = decoder.raw_decode(line, start)
            except ValueError:
                start = line.find('{"', start + 1)
                continue
            if isinstance(obj, dict):
                objects.append(obj)
            kept.append(line[at:start])
            at = end
            start = line.find('{"', end)
        kept.append(line[at:])
        rest.append("".join(kept))
    return objects, rest


def _otlp_value(value: dict):
    """An OTLP/JSON ``AnyValue`` as a Python value (int64 arrives as a string)."""
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [_otlp_value(v) for v in value["arrayValue"].get("values", [])]
    return None


def _otlp_attributes(items) -> dict:
    return {item["key"]: _otlp_value(item.get("value", {})) for item in items or []}


class Telemetry:
    """What the input held, normalised: metric points, spans (their events), resources, Megatron's args."""

    def __init__(self):
        self.points: List[dict] = []  # {resource, name, time, attrs, value, count, sum}
        self.spans: List[dict] = []  # {name, resource, attrs, events: [{name, time, attrs}]}
        self.args: Dict[str, str] = {}
        self.objects = 0
        self.skipped = 0  # JSON objects with a telemetry key but not the exporters' shape

    def add_text(self, text: str) -> None:
        objects, rest = json_objects(text)
        for obj in objects:
            before = (self.objects, len(self.points), len(self.spans))
            try:
                self.add_object(obj)
            except (AttributeError, TypeError, KeyError, ValueError):  # JSON of another shape: not telemetry
                self.skipped += 1  # and nothing of it kept
                self.objects = before[0]
                del self.points[before[1]:], self.spans[before[2]:]
        self._add_arguments(rest)

    def add_object(self, obj: dict) -> None:
        if "resource_metrics" in obj:
            self.objects += 1
            for rm in obj["resource_metrics"]:
                resource = (rm.get("resource") or {}).get("attributes") or {}
                for sm in rm.get("scope_metrics", []):
                    for metric in sm.get("metrics", []):
                        for point in (metric.get("data") or {}).get("data_points", []):
                            self.points.append({"resource": resource, "name": metric["name"],
                                                "time": int(point.get("time_unix_nano") or 0),
                                                "attrs": point.get("attributes") or {}, "value": point.get("value"),
                                                "count": point.get("count"), "sum": point.get("sum")})
        elif "resourceMetrics" in obj:
            self.objects += 1
            for rm in obj["resourceMetrics"]:
                resource = _otlp_attributes((rm.get("resource") or {}).get("attributes"))
                for sm in rm.get("scopeMetrics", []):
                    for metric in sm.get("metrics", []):
                        for kind in ("gauge", "sum", "histogram"):
                            for point in (metric.get(kind) or {}).get("dataPoints", []):
                                value = point.get("asDouble", point.get("asInt"))
                                self.points.append({
                                    "resource": resource, "name": metric["name"],
                                    "time": int(point.get("timeUnixNano") or 0),
                                    "attrs": _otlp_attributes(point.get("attributes")),
                                    "value": None if value is None else float(value),
                                    "count": int(point["count"]) if "count" in point else None,
                                    "sum": float(point["sum"]) if "sum" in point else None})
        elif "resourceSpans" in obj:
            self.objects += 1
            for rs in obj["resourceSpans"]:
                resource = _otlp_attributes((rs.get("resource") or {}).get("attributes"))
                for ss in rs.get("scopeSpans", []):
                    for span in ss.get("spans", []):
                        self.spans.append({"name": span.get("name"), "resource": resource,
                                           "attrs": _otlp_attributes(span.get("attributes")),
                                           "events": [{"name": e.get("name"), "time": e.get("timeUnixNano"),
                                                       "attrs": _otlp_attributes(e.get("attributes"))}
                                                      for e in span.get("events", [])]})
        elif "name" in obj and "context" in obj and "resource" in obj:  # a console span line
            self.objects += 1
            self.spans.append({"name": obj["name"], "resource": (obj.get("resource") or {}).get("attributes") or {},
                               "attrs": obj.get("attributes") or {},
                               "events": [{"name": e.get("name"), "time": e.get("timestamp"),
                                           "attrs": e.get("attributes") or {}} for e in obj.get("events") or []]})

    def _add_arguments(self, lines: List[str]) -> None:
        inside = False
        for line in lines:
            if _ARGS_START.match(line):
                inside = True
            elif _ARGS_END.match(line):
                inside = False
            elif inside:
                match = _ARG_LINE.match(line)
                if match:
                    self.args.setdefault(match.group(1), match.group(2).strip())


def read_inputs(paths: Iterable[str]) -> Tuple[Telemetry, List[str]]:
    """Every input file read into one Telemetry; the files read. ReportError when no telemetry is found."""
    telemetry = Telemetry()
    files = input_files(paths)
    for path in files:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                telemetry.add_text(f.read())
        except OSError as error:
            raise ReportError(f"{path}: cannot be read ({error.strerror})") from None
    if not telemetry.points and not telemetry.spans:
        raise ReportError(f"{', '.join(paths)}: no telemetry found (run with MEGATRON_OTEL_ENABLED=1 "
                          "MEGATRON_OTEL_EXPORTER=console MEGATRON_OTEL_RANK_STRATEGY=all_ranks and give its output, "
                          "or an OTLP JSON file)")
    return telemetry, files


# ------------------------------------------------------------------------------------------------ series
def _resource_key(resource: dict) -> str:
    return str(resource.get("service.instance.id") or json.dumps(resource, sort_keys=True, default=str))


def _rank_of(resource: dict) -> Optional[int]:
    rank = resource.get("dl.rank")
    return int(rank) if rank is not None else None


def build_report_data(telemetry: Telemetry) -> dict:
    """The page's numbers as plain JSON data (what the figures and tables show):

    ``iterations``: ``[{iteration, loss, elapsed_ms, tokens_per_sec, throughput_tflops, learning_rate,
    grad_norm, rank}]`` from the rank that prints the log line; ``validation``: ``[{iteration, split, loss}]``;
    ``breakdown``: ``{rank: [{iteration, <part>: ms, ..., total}]}``; ``straggler``: ``{stage: [{iteration,
    ratio, ...}]}``; ``slow_steps``/``hang_reports``: the events' attributes; ``ranks``: each rank's
    resource labels; ``settings``: the run's common resource attributes; ``args``: Megatron's arguments;
    ``profiles``: ``[{iteration, rank, trace_file}]`` of the step spans that ``--profile`` named;
    ``expert_load`` (MoE runs): ``[{layer, imbalance: [{iteration, value}], tokens_per_expert: [tokens over the
    run, per expert], dropped_tokens}]``.
    """
    snapshots: Dict[Tuple[str, int], List[dict]] = defaultdict(list)
    for point in telemetry.points:
        snapshots[(_resource_key(point["resource"]), point["time"])].append(point)
    # Each snapshot is dated by its iteration gauge; points of a snapshot without one are not placed.
    per_rank_rows: Dict[int, Dict[int, dict]] = defaultdict(dict)
    breakdown: Dict[int, Dict[int, dict]] = defaultdict(dict)
    straggler: Dict[int, Dict[int, dict]] = defaultdict(dict)
    moe: Dict[Optional[int], Dict[tuple, Dict[int, float]]] = defaultdict(dict)  # rank -> (name, layer, expert)
    validation = set()  # (iteration, split, loss)
    histogram_last: Dict[str, Tuple[float, float]] = {}
    validation_last: Dict[Tuple[str, str], float] = {}
    for (resource_key, _), points in sorted(snapshots.items(), key=lambda item: (item[0][0], item[0][1])):
        iteration = next((p["value"] for p in points if p["name"] == _ITERATION and p["value"] is not None), None)
        if iteration is None:
            continue
        iteration = int(iteration)
        resource_rank = _rank_of(points[0]["resource"])
        row = per_rank_rows[resource_rank].setdefault(iteration, {"iteration": iteration})
        for point in points:
            name, attrs = point["name"], point["attrs"]
            if name in _RUN_METRICS and point["value"] is not None:
                row[_RUN_METRICS[name]] = point["value"]
            elif name == _STEP_DURATION and point["count"] is not None:
                count, total = point["count"], point["sum"] or 0.0
                last_count, last_total = histogram_last.get(resource_key, (0, 0.0))
                if count > last_count:
                    row["elapsed_ms"] = (total - last_total) / (count - last_count)
                histogram_last[resource_key] = (count, total)
            elif name.startswith(_STEP_PREFIX) and name.endswith("_ms"):
                rank = attrs.get("dl.rank", resource_rank)
                part = name[len(_STEP_PREFIX):-len("_ms")]
                breakdown[int(rank)].setdefault(iteration, {"iteration": iteration})[part] = point["value"]
            elif name.startswith(_STRAGGLER_PREFIX):
                stage = int(attrs.get("dl.pipeline_parallel.rank", 0))
                key = name[len(_STRAGGLER_PREFIX):]
                straggler[stage].setdefault(iteration, {"iteration": iteration})[key] = point["value"]
            elif name.startswith(_MOE_PREFIX) and point["value"] is not None:
                layer = int(attrs.get("megatron.moe.layer", 0))
                key = (name[len(_MOE_PREFIX):], layer, attrs.get("megatron.moe.expert"))
                moe[resource_rank].setdefault(key, {})[iteration] = point["value"]
            elif name == "megatron.validation.loss" and point["value"] is not None:
                # A gauge is exported again in every later snapshot: an evaluation is where its value changes.
                split = str(attrs.get("megatron.split", "validation"))
                if validation_last.get((resource_key, split)) != point["value"]:
                    validation_last[(resource_key, split)] = point["value"]
                    validation.add((iteration, split, point["value"]))  # each rank exports the same
    with_loss = [rank for rank, rows in per_rank_rows.items() if any("loss" in r for r in rows.values())]
    reporting = max((r for r in with_loss if r is not None), default=None) if with_loss else (
        max((r for r in per_rank_rows if r is not None), default=None))
    iterations = [dict(row, rank=reporting) for _, row in sorted(per_rank_rows.get(reporting, {}).items())]

    # The moe.* points are the layer's global load (summed over the ranks); every exporting rank sends the same.
    moe_rank = min(moe, key=lambda r: -1 if r is None else r) if moe else None
    expert_load = []
    for (name, layer, expert), values in sorted(moe.get(moe_rank, {}).items(), key=lambda kv: str(kv[0])):
        if name == "imbalance":
            expert_load.append({"layer": layer, "imbalance": [{"iteration": it, "value": values[it]}
                                                              for it in sorted(values)]})
    by_layer = {row["layer"]: row for row in expert_load}
    for (name, layer, expert), values in moe.get(moe_rank, {}).items():
        row = by_layer.setdefault(layer, {"layer": layer, "imbalance": []})
        if name == "dropped_tokens":
            row["dropped_tokens"] = sum(values.values())
        elif name == "tokens_per_expert" and expert is not None:
            row.setdefault("tokens_per_expert", {})[int(expert)] = sum(values.values())
    expert_load = [by_layer[layer] for layer in sorted(by_layer)]
    for row in expert_load:
        if "tokens_per_expert" in row:
            row["tokens_per_expert"] = [row["tokens_per_expert"].get(e, 0)
                                        for e in range(max(row["tokens_per_expert"]) + 1)]

    slow_steps, hangs, profiles = [], [], []
    for span in telemetry.spans:
        trace = span["attrs"].get("megatron.profile.trace_file")
        if trace:  # a step profiled with --profile (see docs/observability.md)
            profiles.append({"iteration": span["attrs"].get("megatron.iteration"), "rank": _rank_of(span["resource"]),
                             "trace_file": trace})
        for event in span["events"]:
            if event["name"] in (SLOW_STEP_EVENT, HANG_EVENT):
                record = dict(event["attrs"], reported_by=_rank_of(span["resource"]), span=span["name"],
                              time=event["time"])
                (slow_steps if event["name"] == SLOW_STEP_EVENT else hangs).append(record)
    order = lambda r: (r.get("megatron.iteration") or 0, r.get("reported_by") or 0)  # noqa: E731
    resources = {}
    for item in (*telemetry.points, *telemetry.spans):
        rank = _rank_of(item["resource"])
        if rank is not None and rank not in resources:
            resources[rank] = item["resource"]
    common = dict(resources[min(resources)]) if resources else {}
    for resource in resources.values():
        common = {k: v for k, v in common.items() if resource.get(k) == v}
    ranks = {rank: {k: resource.get(k) for k in _PER_PROCESS if k in resource} for rank, resource in resources.items()}
    return {
        "iterations": iterations,
        "validation": [{"iteration": it, "split": split, "loss": loss} for it, split, loss in sorted(validation)],
        "breakdown": {str(rank): [rows[it] for it in sorted(rows)] for rank, rows in sorted(breakdown.items())},
        "parts": [part for part in BREAKDOWN_PARTS
                  if any(part in row for rows in breakdown.values() for row in rows.values())],
        "straggler": {str(stage): [rows[it] for it in sorted(rows)] for stage, rows in sorted(straggler.items())},
        "expert_load": expert_load,
        "slow_steps": sorted(slow_steps, key=order),
        "hang_reports": sorted(hangs, key=order),
        "profiles": sorted(profiles, key=lambda r: (r["iteration"] or 0, r["rank"] or 0)),
        "ranks": {str(rank): ranks[rank] for rank in sorted(ranks)},
        "settings": {k: common[k] for k in sorted(common) if k not in _PER_PROCESS},
        "args": dict(sorted(telemetry.args.items())),
    }


# ------------------------------------------------------------------------------------------------ figures
def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ReportError("tools/telemetry_report.py needs matplotlib, which is not installed: "
                          "pip install -e \".[report]\" (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Stable ids in the SVG; text as <text> elements (searchable, small; the browser draws the font).
    plt.rcParams.update({"svg.hashsalt": "megatron-report", "svg.fonttype": "none", "font.size": 9})
    return plt


def _svg(plt, fig) -> str:
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.find("<svg"):]  # inline: no XML declaration or doctype


def _iteration_axis(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)


def figure_loss_throughput(plt, data: dict) -> Optional[str]:
    rows = data["iterations"]
    if not rows:
        return None
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.2))
    its = [r["iteration"] for r in rows]
    axes[0].plot(its, [r.get("loss") for r in rows], marker=".", label="training")
    for split in sorted({v["split"] for v in data["validation"]}):
        points = [v for v in data["validation"] if v["split"] == split]
        axes[0].plot([v["iteration"] for v in points], [v["loss"] for v in points], "o", label=split)
    axes[0].set(title="lm loss", xlabel="iteration")
    axes[0].legend()
    for ax, key, title in ((axes[1], "tokens_per_sec", "throughput (tokens/s)"),
                           (axes[2], "throughput_tflops", "throughput per GPU (TFLOP/s)"),
                           (axes[3], "elapsed_ms", "elapsed time per iteration (ms)")):
        ax.plot(its, [r.get(key) for r in rows], marker=".")
        ax.set(title=title, xlabel="iteration")
    for ax in axes:
        _iteration_axis(ax)
    return _svg(plt, fig)


def figure_breakdown(plt, data: dict) -> Optional[str]:
    ranks = list(data["breakdown"])
    if not ranks:
        return None
    parts = [p for p in data["parts"]
             if any(row.get(p) for rows in data["breakdown"].values() for row in rows)]
    columns = min(len(ranks), 2)
    lines = (len(ranks) + columns - 1) // columns
    fig, axes = plt.subplots(lines, columns, figsize=(6.5 * columns, 3.2 * lines), squeeze=False, sharey=True)
    colors = plt.get_cmap("tab10")
    for index, rank in enumerate(ranks):
        ax = axes[index // columns][index % columns]
        rows = data["breakdown"][rank]
        its = [r["iteration"] for r in rows]
        bottom = [0.0] * len(rows)
        for k, part in enumerate(parts):
            values = [max(r.get(part) or 0.0, 0.0) for r in rows]
            ax.bar(its, values, bottom=bottom, label=part, color=colors(k % 10), width=0.8)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set(title=f"rank {rank}", xlabel="iteration", ylabel="ms per iteration")
        _iteration_axis(ax)
    for index in range(len(ranks), lines * columns):
        axes[index // columns][index % columns].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles[::-1], labels[::-1], loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return _svg(plt, fig)


def figure_straggler(plt, data: dict) -> Optional[str]:
    """The straggler ratio per stage; where no stage has one (its fastest rank computes under the ratio's
    floor, MEGATRON_OTEL_STRAGGLER_RATIO_FLOOR_MS), the absolute gap in ms instead."""
    for key, title, baseline in (
            ("ratio", "straggler ratio (slowest / fastest compute in a pipeline stage)", 1.0),
            ("gap_ms", "straggler gap, ms (slowest - fastest compute in a pipeline stage; no ratio under its floor)",
             0.0)):
        stages = [s for s, rows in data["straggler"].items() if any(key in r for r in rows)]
        if stages:
            break
    else:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3))
    for stage in stages:
        rows = [r for r in data["straggler"][stage] if key in r]
        ax.plot([r["iteration"] for r in rows], [r[key] for r in rows], marker=".", label=f"stage {stage}")
    ax.set(title=title, xlabel="iteration")
    ax.axhline(baseline, color="grey", lw=0.8)
    ax.legend()
    _iteration_axis(ax)
    return _svg(plt, fig)


def figure_expert_imbalance(plt, data: dict) -> Optional[str]:
    """Per MoE layer, the most loaded expert's tokens over the mean, per log interval."""
    layers = [row for row in data["expert_load"] if row["imbalance"]]
    if not layers:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3))
    for row in layers:
        ax.plot([p["iteration"] for p in row["imbalance"]], [p["value"] for p in row["imbalance"]], marker=".",
                label=f"layer {row['layer']}")
    ax.set(title="expert load imbalance (max / mean tokens per expert)", xlabel="iteration")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.legend(fontsize=8)
    _iteration_axis(ax)
    return _svg(plt, fig)


# ------------------------------------------------------------------------------------------------ HTML
def _cell(value) -> str:
    if isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, (list, tuple)):
        text = ", ".join(str(v) for v in value)
    else:
        text = "" if value is None else str(value)
    return f"<td>{html.escape(text)}</td>"


def _table(table_id: str, columns: List[str], rows: List[dict], headers: Optional[List[str]] = None) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in (headers or columns))
    body = "".join("<tr>" + "".join(_cell(row.get(c)) for c in columns) + "</tr>" for row in rows)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _other_attributes(row: dict, shown: List[str]) -> str:
    """An event's attributes that have no column of their own (what a hang report adds: node, pid, the
    collective a rank waits in, ...), as ``key=value`` text."""
    return "; ".join(f"{key}={row[key]}" for key in sorted(row) if key not in shown and key not in ("span", "time"))


def _figure(svg: Optional[str], missing: str) -> str:
    return f'<div class="figure">{svg}</div>' if svg else f'<p class="missing">{html.escape(missing)}</p>'


_STYLE = """body{font-family:sans-serif;margin:1.5em;color:#222;max-width:1400px}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;font-size:0.85em;margin:0.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}
th{background:#f0f0f0}.missing{color:#888}.figure svg{max-width:100%;height:auto}
details{margin:0.5em 0}.ok{color:#2a7}"""


def render_html(data: dict, files: List[str], plt) -> str:
    """The page: figures (inline SVG), tables and the data block ``report-data``."""
    run_id = data["settings"].get("nemo.run.id", "")
    iteration_columns = ["iteration", "loss", "elapsed_ms", "tokens_per_sec", "throughput_tflops", "learning_rate",
                         "grad_norm"]
    parts = data["parts"]
    means = []
    for rank, rows in data["breakdown"].items():
        mean = {"rank": rank, "iterations": len(rows)}
        for part in [*parts, "total"]:
            values = [r[part] for r in rows if r.get(part) is not None]
            mean[part] = sum(values) / len(values) if values else None
        means.append(mean)
    straggler_rows = [dict(row, stage=stage) for stage, rows in data["straggler"].items() for row in rows]
    straggler_keys = sorted({k for row in straggler_rows for k in row} - {"stage", "iteration"})
    slow_cols = [*SLOW_STEP_COLUMNS, "reported_by", "other"]
    hang_cols = [*HANG_COLUMNS, "reported_by", "other"]
    slow_rows = [dict(row, other=_other_attributes(row, slow_cols)) for row in data["slow_steps"]]
    hang_rows = [dict(row, other=_other_attributes(row, hang_cols)) for row in data["hang_reports"]]
    sections = [
        f"<h1>Training run report {html.escape(str(run_id))}</h1>",
        f"<p>{len(data['ranks'])} rank(s) exported telemetry; {len(data['iterations'])} logged iteration(s); read "
        f"from {len(files)} file(s): {html.escape(', '.join(files[:8]))}{' ...' if len(files) > 8 else ''}.</p>",
        "<h2>Loss and throughput</h2>",
        _figure(figure_loss_throughput(plt, data), "no training metrics in the input"),
        f"<p>Values of rank {html.escape(str(data['iterations'][0]['rank']) if data['iterations'] else '-')} "
        "(the rank that prints the log line).</p>",
        _table("iterations", iteration_columns, data["iterations"],
               ["iteration", "lm loss", "elapsed ms/iteration", "tokens/s", "TFLOP/s/GPU", "learning rate",
                "grad norm"]),
        "<h2>Step breakdown per rank</h2>",
        "<p>Exclusive time per iteration of each part of a step (ms, averaged over the log interval).</p>",
        _figure(figure_breakdown(plt, data), "no step breakdown in the input (telemetry metrics were off)"),
        _table("breakdown-means", ["rank", "iterations", *parts, "total"], means),
        "<h2>Stragglers per pipeline stage</h2>",
        _figure(figure_straggler(plt, data), "no straggler series in the input"),
        _table("straggler", ["stage", "iteration", *straggler_keys], straggler_rows),
        *([
            "<h2>Expert load (MoE)</h2>",
            _figure(figure_expert_imbalance(plt, data), "no imbalance series in the input"),
            _table("expert-load", ["layer", "mean_imbalance", "max_imbalance", "tokens_per_expert", "dropped_tokens"],
                   [{"layer": row["layer"],
                     "mean_imbalance": (sum(p["value"] for p in row["imbalance"]) / len(row["imbalance"])
                                        if row["imbalance"] else None),
                     "max_imbalance": max((p["value"] for p in row["imbalance"]), default=None),
                     "tokens_per_expert": " ".join(str(int(v)) for v in row.get("tokens_per_expert", [])),
                     "dropped_tokens": row.get("dropped_tokens")} for row in data["expert_load"]],
                   ["layer", "mean imbalance", "max imbalance", "tokens per expert (whole run)", "dropped tokens"]),
        ] if data["expert_load"] else []),
        "<h2>Slow steps</h2>",
        _table("slow-steps", slow_cols, slow_rows,
               ["iteration", "rank", "x median", "part that grew", "delta ms", "reported by", "other attributes"])
        if data["slow_steps"] else '<p class="ok">No slow step was reported.</p>',
        "<h2>Hang reports</h2>",
        _table("hang-reports", hang_cols, hang_rows,
               ["iteration", "stalled ranks", "phase", "seconds", "reported by", "other attributes"])
        if data["hang_reports"] else '<p class="ok">No hang was reported.</p>',
        "<h2>Profiled iterations</h2>",
        _table("profiles", ["iteration", "rank", "trace_file"], data["profiles"], ["iteration", "rank", "trace file"])
        if data["profiles"] else "<p>No profiled step span in the input (--profile, with "
        "MEGATRON_OTEL_SPAN_GROUPS=per_step).</p>",
        "<h2>Settings</h2>",
        _table("ranks", ["rank", *_PER_PROCESS],
               [dict(v, rank=k) for k, v in data["ranks"].items()]),
        _table("settings", ["name", "value"], [{"name": k, "value": v} for k, v in data["settings"].items()]),
    ]
    if data["args"]:
        sections.append("<details><summary>Megatron arguments (from the log)</summary>"
                        + _table("args", ["name", "value"], [{"name": k, "value": v} for k, v in data["args"].items()])
                        + "</details>")
    payload = json.dumps(data, sort_keys=True, default=str).replace("</", "<\\/")
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>Training run report</title>"
            f"<style>{_STYLE}</style></head><body>\n" + "\n".join(sections)
            + f'\n<script type="application/json" id="report-data">{payload}</script>\n</body></html>\n')


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_output", nargs="+", metavar="RUN_OUTPUT",
                        help="a run's console telemetry (file or folder) or an OTLP JSON file")
    parser.add_argument("-o", "--output", required=True, help="the HTML file to write")
    args = parser.parse_args(argv)
    try:
        plt = _pyplot()
        telemetry, files = read_inputs(args.run_output)
        page = render_html(build_report_data(telemetry), files, plt)
        directory = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(directory):
            raise ReportError(f"-o {args.output}: the folder {directory} does not exist")
        if os.path.isdir(args.output):
            raise ReportError(f"-o {args.output}: is a folder; give the HTML file to write, e.g. "
                              f"{os.path.join(args.output, 'report.html')}")
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(page)
        except OSError as error:
            raise ReportError(f"-o {args.output}: cannot be written ({error.strerror})") from None
    except ReportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} ({len(page) // 1024} KB) from {telemetry.objects} telemetry objects in "
          f"{len(files)} file(s)" + (f"; {telemetry.skipped} malformed object(s) skipped" if telemetry.skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
