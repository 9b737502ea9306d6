"""A real Prometheus (Debian's package, 127.0.0.1 only) scrapes a short training run's pull endpoint
(MEGATRON_OTEL_METRICS_EXPORTER=prometheus) and every query of the Grafana dashboard returns data (the run is a
small MoE model, so the expert-load panels are queried too)."""
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from dist_utils import free_port
from pretrain_utils import REPO, _pretrain_argv
from telemetry_testutil import clean_telemetry  # noqa: F401

DASHBOARD = REPO / "observability" / "grafana" / "dashboards" / "megatron-training.json"
RUN_ID = "promtest"
SERVICE = "megatron-promtest"


@pytest.fixture(scope="module")
def prometheus_binary():
    """The ``prometheus`` binary on PATH. The tests never install it (``pytest tests`` changes nothing outside
    the checkout); ``.ci/run`` installs Debian's package before running them."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the prometheus binary is not on PATH (install it, e.g. apt-get install prometheus on "
                    "Debian/Ubuntu, to run this test; .ci/run does)")
    return binary


def _get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read().decode())


def _dashboard_queries():
    """(panel title, expr) of every target, and the template variables' label queries."""
    dashboard = json.loads(DASHBOARD.read_text())
    targets = [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    return targets, variables


def _substitute(expr, variables):
    expr = expr.replace("$__rate_interval", "15s")
    for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    return expr


@pytest.mark.timeout(600)
def test_every_dashboard_query_returns_data_from_a_real_prometheus(prometheus_binary, shared_data, shakespeare_prefix,
                                                                    tmp_path):
    metrics_port, prom_port = free_port(), free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: megatron\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{metrics_port}']\n")
    prometheus = subprocess.Popen(
        [prometheus_binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
    api = f"http://127.0.0.1:{prom_port}/api/v1"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/-/ready", timeout=2)
                break
            except OSError:
                assert prometheus.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "prometheus did not become ready"
                time.sleep(0.5)
        env = dict(os.environ, OMP_NUM_THREADS="1", MEGATRON_OTEL_ENABLED="1", MEGATRON_OTEL_TRACES_ENABLED="0",
                   MEGATRON_OTEL_METRICS_EXPORTER="prometheus", MEGATRON_OTEL_PROMETHEUS_HOST="127.0.0.1",
                   MEGATRON_OTEL_PROMETHEUS_PORT=str(metrics_port), MEGATRON_OTEL_RUN_ID=RUN_ID,
                   OTEL_SERVICE_NAME=SERVICE, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                   LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   # this tiny model computes a few ms per iteration: report the straggler ratio anyway
                   MEGATRON_OTEL_STRAGGLER_RATIO_FLOOR_MS="0")
        # The run is held inside its final save (the checkpoint test hook) until Prometheus has scraped the
        # finished run's series a few times: a fast run can otherwise end between two scrapes.
        marker, release = tmp_path / "in_final_save", tmp_path / "release"
        env.update(MEGATRON_TEST_SLEEP_IN_SAVE="300", MEGATRON_TEST_HOOK_ITERATION="12",
                   MEGATRON_TEST_HOOK_MARKER=str(marker), MEGATRON_TEST_HOOK_RELEASE=str(release))
        argv = [sys.executable, *_pretrain_argv(
            ["--micro-batch-size", "4", "--train-iters", "12", "--log-interval", "2", "--eval-interval", "6",
             "--save", str(tmp_path / "ckpt"), "--save-interval", "12",
             # an MoE model, so that the expert-load panels have data too (1 rank: ep_comm is 0)
             "--num-experts", "4", "--moe-router-topk", "2", "--moe-expert-capacity-factor", "1.0",
             "--disable-bias-linear"],
            shared_data, shakespeare_prefix, tmp_path)]
        argv[1] = "tests/faulty_pretrain.py"  # pretrain_gpt.py with the MEGATRON_TEST_* hooks
        scraped = urllib.parse.urlencode(
            {"query": 'count_over_time({__name__=~"megatron_training_iteration(_ratio)?"}[10m])'})
        start = time.time()
        with open(tmp_path / "run.log", "w+") as log:
            run = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 300
                while True:
                    assert run.poll() is None, "the run ended before its final save was held"
                    assert time.monotonic() < deadline, "Prometheus did not scrape the held run"
                    if marker.exists():
                        result = _get(f"{api}/query?{scraped}")["data"]["result"]
                        if result and float(result[0]["value"][1]) >= 3:
                            break
                    time.sleep(0.5)
            finally:
                release.touch()
                try:
                    run.wait(timeout=300)
                finally:
                    if run.poll() is None:
                        run.kill()
                        run.wait()
            end = time.time()
            log.seek(0)
            output = log.read()
        assert run.returncode == 0, output[-3000:]

        targets, variables = _dashboard_queries()
        values = {"service_name": SERVICE, "run_id": RUN_ID, "peak_tflops": variables["peak_tflops"]["query"],
                  "datasource": "prometheus"}
        for name in ("service_name", "run_id"):  # the template variables list this run
            query = _substitute(variables[name]["query"]["query"], values)
            selector, label = query[len("label_values("):-1].rsplit(",", 1)
            params = urllib.parse.urlencode({"match[]": selector, "start": start - 5, "end": end + 5})
            listed = _get(f"{api}/label/{label.strip()}/values?{params}")["data"]
            assert values[name] in listed, (name, query, listed)
        empty = []
        for title, expr in targets:
            query = _substitute(expr, values)
            params = urllib.parse.urlencode({"query": query, "start": start, "end": end + 2, "step": "1s"})
            answer = _get(f"{api}/query_range?{params}")
            assert answer["status"] == "success", (title, query, answer)
            if not any(series["values"] for series in answer["data"]["result"]):
                empty.append((title, query))
        assert not empty, f"dashboard queries without data: {empty}"
        assert len(targets) >= 20
    finally:
        prometheus.terminate()
        try:
            prometheus.wait(timeout=20)
        except subprocess.TimeoutExpired:
            prometheus.kill()
            prometheus.wait()


def test_stack_configs_are_consistent(prometheus_binary):
    """The shipped Prometheus config passes promtool; the collector's pipelines use only components it
    defines, traces go to Jaeger/Tempo and metrics to Prometheus with resource attributes as labels."""
    import yaml

    promtool = shutil.which("promtool") or str(Path(prometheus_binary).with_name("promtool"))
    if Path(promtool).exists():
        check = subprocess.run([promtool, "check", "config", str(REPO / "observability" / "prometheus.yml")],
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
    collector = yaml.safe_load((REPO / "observability" / "otel-collector.yaml").read_text())
    pipelines = collector["service"]["pipelines"]
    for pipeline in pipelines.values():
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipeline.get(kind, [])) <= set(collector[kind]), (kind, pipeline)
    assert pipelines["traces"]["receivers"] == ["otlp"] and pipelines["metrics"]["receivers"] == ["otlp"]
    assert {"otlp/jaeger", "otlp/tempo"} <= set(pipelines["traces"]["exporters"])
    assert pipelines["metrics"]["exporters"] == ["prometheus"]
    # resource attributes become labels through transform/promote_resource (tests/telemetry/test_observability_stack.py)
    assert collector["exporters"]["prometheus"]["resource_to_telemetry_conversion"]["enabled"] is False
    assert "transform/promote_resource" in pipelines["metrics"]["processors"]
    compose = yaml.safe_load((REPO / "observability" / "compose.yaml").read_text())
    assert {"otel-collector", "jaeger", "tempo", "prometheus", "grafana"} <= set(compose["services"])
    _, variables = _dashboard_queries()
    assert {"service_name", "run_id"} <= set(variables)


def test_metrics_exporter_setting_is_checked_on_every_rank():
    from megatron.core import telemetry as tel

    with pytest.raises(ValueError, match="MEGATRON_OTEL_METRICS_EXPORTER='prom'.*prometheus"):
        tel.TelemetryConfig.from_env(environ={"MEGATRON_OTEL_METRICS_EXPORTER": "prom"}).validate()
    with pytest.raises(ValueError, match="MEGATRON_OTEL_PROMETHEUS_PORT"):
        tel.TelemetryConfig.from_env(environ={"MEGATRON_OTEL_PROMETHEUS_PORT": "70000"}).validate()
    config = tel.TelemetryConfig.from_env(environ={"NEMO_LENS_METRICS_EXPORTER": "Prometheus"})
    assert config.validate().metrics_exporter == "prometheus"


def test_pull_endpoint_labels_series_with_the_resource():
    pytest.importorskip("opentelemetry.exporter.prometheus")
    from megatron.core import telemetry as tel

    port = free_port()
    config = tel.TelemetryConfig(enabled=True, traces_enabled=False, metrics_exporter="prometheus",
                                 prometheus_port=port, run_id="labels")
    handle = tel.setup_telemetry(config, 0, 1, {"dl.local_rank": 0, "dl.tensor_parallel.rank": 0})
    try:
        tel.record_training_metrics(handle.meter, loss=2.5)
        tel.record_training_metrics(handle.meter, step_forward_compute_ms=3.0, attributes={"dl.rank": 0})
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        handle.shutdown(timeout_ms=2000)
    loss = next(line for line in text.splitlines() if line.startswith("megatron_training_loss{"))
    assert 'nemo_run_id="labels"' in loss and 'service_name="megatron-lm"' in loss and loss.endswith(" 2.5")
    assert 'dl_tensor_parallel_rank="0"' in loss
    part = next(line for line in text.splitlines() if line.startswith("megatron_training_step_forward_compute_ms"))
    assert 'dl_rank="0"' in part
    with pytest.raises(OSError):  # the endpoint is closed at shutdown
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
