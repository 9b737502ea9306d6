"""tools/telemetry_report.py: the HTML page of a real 2-rank run's console telemetry checked against the run's own log
lines; the slow-step and hang tables from SDK spans written as console lines and as OTLP JSON; the one-line errors."""
import json
import re
import subprocess
import sys

import pytest

from pretrain_utils import REPO, log_line_matches, run_pretrain

pytest.importorskip("matplotlib", reason="tools/telemetry_report.py draws with matplotlib (the [report] extra)")
pytestmark = pytest.mark.timeout(240)

TOOL = REPO / "tools" / "telemetry_report.py"
LOG_LINE = re.compile(
    r"iteration\s+(?P<iteration>\d+)/\s+\d+ \| consumed samples:\s+\d+ \| elapsed time per iteration \(ms\): "
    r"(?P<elapsed>[0-9.]+) \| throughput per GPU \(TFLOP/s/GPU\): (?P<tflops>[0-9.]+) \| learning rate: "
    r"(?P<lr>[0-9.]+E[+-]\d+) \| global batch size:\s+\d+ \| lm loss: (?P<loss>[0-9.]+E[+-]\d+) \| loss scale: "
    r"[0-9.]+ \| grad norm: (?P<grad_norm>[0-9.]+) \|")


def _report(inputs, out, check=True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *map(str, inputs), "-o", str(out)], cwd=REPO, text=True,
                          capture_output=True, check=check, timeout=120)


def _page_data(page: str) -> dict:
    block = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    return json.loads(block.group(1))


def _assert_offline(page: str) -> None:
    """Nothing the browser would fetch: no src/link/import, and every href is a fragment (#id)."""
    assert not re.search(r"<(?:link|img|iframe)\b|\bsrc=|@import|url\((?!#)", page)
    assert all(ref.startswith("#") for ref in re.findall(r'href="([^"]*)"', page))


def test_report_of_a_two_rank_run_matches_its_log_lines(shared_data, shakespeare_prefix, tmp_path, monkeypatch):
    """Console telemetry from both ranks (all_ranks) -> one page with both ranks' stacked breakdowns; the
    page's loss, elapsed time, TFLOP/s, learning rate and grad norm per iteration are the log line's."""
    monkeypatch.setenv("MEGATRON_OTEL_ENABLED", "1")
    monkeypatch.setenv("MEGATRON_OTEL_EXPORTER", "console")
    monkeypatch.setenv("MEGATRON_OTEL_RANK_STRATEGY", "all_ranks")
    out = run_pretrain(2, ["--micro-batch-size", "4", "--train-iters", "5", "--eval-interval", "100",
                           "--log-throughput"], shared_data, shakespeare_prefix, tmp_path)
    log = tmp_path / "run.log"
    log.write_text(out)
    result = _report([log], tmp_path / "report.html")
    assert result.stdout.startswith(f"wrote {tmp_path / 'report.html'} (")
    page = (tmp_path / "report.html").read_text()
    _assert_offline(page)
    data = _page_data(page)

    logged = {int(m["iteration"]): m for m in log_line_matches(out, LOG_LINE)}
    assert sorted(logged) == [1, 2, 3, 4, 5]
    rows = {row["iteration"]: row for row in data["iterations"]}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    for iteration, line in logged.items():
        row = rows[iteration]
        assert row["rank"] == 1  # the last rank prints the log line
        assert f"{row['loss']:.6E}" == line["loss"]
        assert f"{row['learning_rate']:.6E}" == line["lr"]
        assert f"{row['grad_norm']:.3f}" == line["grad_norm"]
        assert f"{row['throughput_tflops']:.1f}" == line["tflops"]
        # The histogram's sum difference may differ from the recorded value in its last bits.
        assert abs(row["elapsed_ms"] - float(line["elapsed"])) <= 0.05 + 1e-6, (row, line["elapsed"])
        # tokens/s is global batch x sequence / elapsed time (8 x 32 tokens)
        assert row["tokens_per_sec"] == pytest.approx(8 * 32 / (row["elapsed_ms"] / 1000.0), rel=1e-6)

    final = re.search(r"validation loss at iteration 5 on validation set \| lm loss value: ([0-9.]+E[+-]\d+)", out)
    assert [(v["iteration"], v["split"], f"{v['loss']:.6E}") for v in data["validation"]] == [
        (5, "validation", final.group(1))]

    from megatron.core.step_timing import PARTS

    assert data["parts"] == [*PARTS, "other"]  # ep_comm included: read from step_timing.PARTS
    assert sorted(data["breakdown"]) == ["0", "1"]
    for rank, rows in data["breakdown"].items():
        assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]
        for r in rows:  # the parts add up to the rank's step total
            assert sum(r[p] for p in data["parts"]) == pytest.approx(r["total"], rel=1e-6, abs=1e-6)
            assert r["forward_compute"] > 0 and r["backward_compute"] > 0
    # The breakdown figure draws one panel per rank (SVG text elements), and the straggler ratio of stage 0.
    assert page.count(">rank 0</text>") == 1 and page.count(">rank 1</text>") == 1
    assert [r["iteration"] for r in data["straggler"]["0"]] == [1, 2, 3, 4, 5]
    # The gap is always there; the ratio only where the stage's fastest rank computes at least the floor (50 ms).
    for r in data["straggler"]["0"]:
        assert r["gap_ms"] == pytest.approx(r["slowest_compute_ms"] - r["fastest_compute_ms"], abs=1e-6)
        assert ("ratio" in r) == (r["fastest_compute_ms"] >= 50.0) and r.get("ratio", 1.0) >= 1.0
    assert "straggler ratio" in page or "straggler gap, ms" in page
    assert data["settings"]["dl.world_size"] == 2 and data["settings"]["megatron.num_layers"] == 2
    assert sorted(data["ranks"]) == ["0", "1"]
    assert data["args"]["hidden_size"] == "32"  # Megatron's arguments block, read from the log
    assert 'id="slow-steps"' not in page and "No slow step was reported." in page

    # The same run read from a folder of per-rank files (torchrun --log-dir): the same numbers.
    folder = tmp_path / "logs"
    for rank in (0, 1):
        (folder / "attempt_0" / str(rank)).mkdir(parents=True)
    lines = out.splitlines(keepends=True)
    (folder / "attempt_0" / "0" / "stdout.log").write_text("".join(lines[::2]))
    (folder / "attempt_0" / "1" / "stdout.log").write_text("".join(lines[1::2]))
    _report([folder], tmp_path / "again.html")
    again = _page_data((tmp_path / "again.html").read_text())
    assert again["iterations"] == data["iterations"] and again["breakdown"] == data["breakdown"]


def _synthetic_spans():
    """Two ranks' SDK spans carrying megatron.slow_step and megatron.hang_report events (what the hang and
    slow-step checks emit), plus each rank's metric snapshot of iteration 7."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    spans, metrics = [], []
    for rank in (0, 1):
        resource = Resource.create({"dl.rank": rank, "dl.world_size": 2, "service.instance.id": f"run-rank{rank}",
                                    "nemo.run.id": "run"})
        exporter = InMemorySpanExporter()
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        with provider.get_tracer("t").start_as_current_span("megatron.train") as span:
            span.add_event("megatron.slow_step", {
                "megatron.iteration": 812 + rank, "megatron.slow_step.ratio": 3.4, "megatron.slow_step.part": "data_wait",
                "megatron.slow_step.delta_ms": 2100.0, "megatron.slow_step.rank": 5})
            if rank == 0:
                span.add_event("megatron.hang_report", {
                    "megatron.iteration": 815, "megatron.hang.stalled_ranks": [1], "megatron.hang.phase": "backward",
                    "megatron.hang.seconds": 12.5, "megatron.hang.blocked_in": "all_reduce (dp group)"})
        spans.extend(exporter.get_finished_spans())
        reader = InMemoryMetricReader()
        meter = MeterProvider(resource=resource, metric_readers=[reader]).get_meter("m")
        meter.create_gauge("megatron.training.iteration").set(7)
        meter.create_gauge("megatron.training.loss").set(4.5 + rank)
        meter.create_gauge("megatron.training.step.forward_compute_ms").set(10.0 + rank, {"dl.rank": rank})
        metrics.append(reader.get_metrics_data())
    return spans, metrics


def test_slow_step_and_hang_tables_from_console_lines_and_from_otlp_json(tmp_path):
    from google.protobuf.json_format import MessageToDict
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from megatron.core.telemetry.console_format import MetricsLineFormatter, SpanLineFormatter

    spans, metrics = _synthetic_spans()
    console = tmp_path / "console.log"
    console.write_text("training ...\n" + "".join(SpanLineFormatter()(s) for s in spans)
                       + "".join(MetricsLineFormatter()(m) for m in metrics))
    otlp = tmp_path / "otlp.json"  # the collector's file exporter: one OTLP/JSON request per line
    otlp.write_text("".join(json.dumps(MessageToDict(request)) + "\n"
                            for request in [encode_spans(spans), *map(encode_metrics, metrics)]))
    pages = {}
    for name, source in (("console", console), ("otlp", otlp)):
        _report([source], tmp_path / f"{name}.html")
        pages[name] = (tmp_path / f"{name}.html").read_text()
        _assert_offline(pages[name])
    data = {name: _page_data(page) for name, page in pages.items()}
    for name in data:
        for rows in (data[name]["slow_steps"], data[name]["hang_reports"]):
            for row in rows:
                del row["time"]  # console: ISO text, OTLP: nanoseconds
    assert data["console"]["slow_steps"] == data["otlp"]["slow_steps"] == [
        {"megatron.iteration": 812, "megatron.slow_step.ratio": 3.4, "megatron.slow_step.part": "data_wait",
         "megatron.slow_step.delta_ms": 2100.0, "megatron.slow_step.rank": 5, "reported_by": 0,
         "span": "megatron.train"},
        {"megatron.iteration": 813, "megatron.slow_step.ratio": 3.4, "megatron.slow_step.part": "data_wait",
         "megatron.slow_step.delta_ms": 2100.0, "megatron.slow_step.rank": 5, "reported_by": 1,
         "span": "megatron.train"}]
    assert data["console"]["hang_reports"] == data["otlp"]["hang_reports"] == [
        {"megatron.iteration": 815, "megatron.hang.stalled_ranks": [1], "megatron.hang.phase": "backward",
         "megatron.hang.seconds": 12.5, "megatron.hang.blocked_in": "all_reduce (dp group)", "reported_by": 0,
         "span": "megatron.train"}]
    for page in pages.values():
        slow = re.search(r'<table id="slow-steps">.*?</table>', page, re.S).group(0)
        assert "<td>812</td><td>5</td><td>3.4</td><td>data_wait</td><td>2100</td><td>0</td><td></td>" in slow
        hang = re.search(r'<table id="hang-reports">.*?</table>', page, re.S).group(0)
        assert ("<td>815</td><td>1</td><td>backward</td><td>12.5</td><td>0</td>"
                "<td>megatron.hang.blocked_in=all_reduce (dp group)</td>") in hang
    for name in data:  # the metric snapshots, dated by their iteration gauge, in both formats
        assert data[name]["iterations"] == [{"iteration": 7, "loss": 5.5, "rank": 1}]
        assert data[name]["breakdown"] == {"0": [{"iteration": 7, "forward_compute": 10.0}],
                                           "1": [{"iteration": 7, "forward_compute": 11.0}]}


def test_input_errors_and_missing_matplotlib_are_one_line(tmp_path):
    missing = _report([tmp_path / "nope.log"], tmp_path / "r.html", check=False)
    assert (missing.returncode, missing.stderr) == (1, f"error: {tmp_path / 'nope.log'}: no such file or folder\n")
    plain = tmp_path / "plain.log"
    plain.write_text("no telemetry here\n")
    empty = _report([plain], tmp_path / "r.html", check=False)
    assert empty.returncode == 1 and empty.stderr.startswith(f"error: {plain}: no telemetry found (run with "
                                                             "MEGATRON_OTEL_ENABLED=1") and empty.stderr.count("\n") == 1
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; "
            f"sys.argv = ['telemetry_report.py', {str(plain)!r}, '-o', 'x.html']; "
            f"runpy.run_path({str(TOOL)!r}, run_name='__main__')")
    no_mpl = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, text=True, capture_output=True, timeout=120)
    assert no_mpl.returncode == 1
    assert no_mpl.stderr == ("error: tools/telemetry_report.py needs matplotlib, which is not installed: "
                             "pip install -e \".[report]\" (or pip install matplotlib)\n")


def test_malformed_telemetry_objects_are_skipped_and_a_folder_output_is_one_line(tmp_path):
    """JSON with a telemetry key but another shape (a truncated or foreign object) is skipped whole, counted in
    the summary, and leaves the page of the good lines unchanged; ``-o`` naming a folder is a one-line error."""
    from megatron.core.telemetry.console_format import MetricsLineFormatter, SpanLineFormatter

    spans, metrics = _synthetic_spans()
    good = "".join(SpanLineFormatter()(s) for s in spans) + "".join(MetricsLineFormatter()(m) for m in metrics)
    clean, dirty = tmp_path / "clean.log", tmp_path / "dirty.log"
    clean.write_text(good)
    dirty.write_text('{"resourceMetrics": "not a list"}\n'
                     '{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "x", "events": [7]}]}]}]}\n' + good)
    _report([clean], tmp_path / "clean.html")
    result = _report([dirty], tmp_path / "dirty.html")
    assert result.stdout.rstrip().endswith("; 2 malformed object(s) skipped"), result.stdout
    assert (_page_data((tmp_path / "clean.html").read_text())
            == _page_data((tmp_path / "dirty.html").read_text().replace(str(dirty), str(clean))))
    folder = _report([clean], tmp_path, check=False)
    assert (folder.returncode, folder.stderr) == (1, f"error: -o {tmp_path}: is a folder; give the HTML file to "
                                                     f"write, e.g. {tmp_path / 'report.html'}\n")


def test_expert_load_of_an_moe_run(tmp_path):
    """A one-process MoE run (4 experts, top-2, 2 MoE layers) with console telemetry: the page's expert-load table
    has both layers, and every layer's tokens per expert add up to tokens x top-k x iterations (dropless: each
    token is counted once per chosen expert)."""
    import os

    from pretrain_utils import run_ranks

    iters, global_batch, seq = 4, 8, 16
    env = dict(os.environ, MEGATRON_OTEL_ENABLED="1", MEGATRON_OTEL_EXPORTER="console",
               MEGATRON_OTEL_RANK_STRATEGY="all_ranks")
    argv = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "100", "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2",
            "--moe-aux-loss-coeff", "1e-2", "--micro-batch-size", "2", "--global-batch-size", str(global_batch),
            "--lr", "1e-3", "--mock-data", "--eval-iters", "0", "--num-workers", "0", "--log-interval", "1",
            "--train-iters", str(iters), "--distributed-backend", "gloo"]
    result = run_ranks(1, argv, env=env, timeout=200)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (tmp_path / "run.log").write_text(result.stdout)
    _report([tmp_path / "run.log"], tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    load = _page_data(page)["expert_load"]
    assert [row["layer"] for row in load] == [1, 2]
    for row in load:
        assert len(row["tokens_per_expert"]) == 4
        assert sum(row["tokens_per_expert"]) == iters * global_batch * seq * 2, row
        assert row["dropped_tokens"] == 0
        assert [p["iteration"] for p in row["imbalance"]] == list(range(1, iters + 1))
        assert all(p["value"] >= 1.0 for p in row["imbalance"])
    assert 'id="expert-load"' in page and "expert load imbalance" in page
