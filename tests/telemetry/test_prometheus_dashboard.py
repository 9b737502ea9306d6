"""A real Prometheus (Debian's package, 127.0.0.1 only) scrapes a short training run's pull endpoint
(MEGATRON_OTEL_METRICS_EXPORTER=prometheus) and every query of the Grafana dashboard returns data."""
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


def _install_prometheus():
    """The ``prometheus`` binary: on PATH, else installed with apt-get (root, Debian/Ubuntu), else None."""
    found = shutil.which("prometheus")
    if found or os.geteuid() != 0 or not shutil.which("apt-get"):
        return found
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "prometheus"], env=env,
                   capture_output=True, timeout=600)
    return shutil.which("prometheus")


@pytest.fixture(scope="module")
def prometheus_binary():
    binary = _install_prometheus()
    if binary is None:
        pytest.skip("the prometheus binary is not installed and could not be installed "
                    "(apt-get install prometheus needs root on Debian/Ubuntu)")
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
                   LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        argv = [sys.executable, *_pretrain_argv(
            ["--micro-batch-size", "4", "--train-iters", "12", "--log-interval", "2", "--eval-interval", "6"],
            shared_data, shakespeare_prefix, tmp_path)]
        start = time.time()
        run = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
        end = time.time()
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

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
