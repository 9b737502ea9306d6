"""The observability stack keeps each series' own labels (issue 32, item 5): the collector promotes resource
attributes only where a point lacks them (run through a real collector when one is installed, else its
structure is checked), stage-level series carry stage labels only (collector and pull endpoint), and the
compose stack, prometheus.yml and the documented pull-mode command agree."""
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request

import pytest
import yaml

from megatron.core import telemetry as tel
from megatron.core.telemetry.prometheus_reader import STAGE_LEVEL_METRIC_PREFIX, STAGE_RESOURCE_ATTRIBUTES
from pretrain_utils import REPO
from telemetry_testutil import clean_telemetry  # noqa: F401

STACK = REPO / "observability"
PROMOTE = "transform/promote_resource"
# What a rank that relays another rank's row sends: its own resource, the row's own coordinates.
SENDER = {"service.name": "megatron-lm", "service.instance.id": "run7-rank1", "nemo.run.id": "run7",
          "host.name": "node-b", "dl.rank": 1, "dl.local_rank": 1, "dl.tensor_parallel.rank": 0,
          "dl.pipeline_parallel.rank": 1, "dl.data_parallel.rank": 0}
RELAYED_ROW = {"dl.rank": 0, "dl.local_rank": 0, "dl.tensor_parallel.rank": 0, "dl.pipeline_parallel.rank": 0,
               "dl.data_parallel.rank": 0, "service.instance.id": "run7-rank0"}
RANK_LABELS = ("dl_rank", "dl_local_rank", "dl_tensor_parallel_rank", "dl_data_parallel_rank", "service_instance_id",
               "host_name")


def _collector():
    return yaml.safe_load((STACK / "otel-collector.yaml").read_text())


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------- collector
def test_collector_config_promotes_resource_attributes_only_where_points_lack_them():
    """Structure of the shipped config (what a real collector would run is checked by the next test)."""
    config = _collector()
    assert config["exporters"]["prometheus"]["resource_to_telemetry_conversion"]["enabled"] is False
    metrics = config["service"]["pipelines"]["metrics"]["processors"]
    assert PROMOTE in metrics and metrics.index(PROMOTE) < metrics.index("batch")
    for name in metrics:  # nothing else in the metrics pipeline rewrites attributes
        assert not name.startswith(("resource", "attributes")), name
    (group,) = config["processors"][PROMOTE]["metric_statements"]
    assert group["context"] == "datapoint"
    stage = re.escape(STAGE_LEVEL_METRIC_PREFIX).replace("\\", "\\\\")  # as written inside an OTTL string
    merge, *sets = group["statements"]
    # "insert": a key the point has already is kept; every other resource attribute becomes a label.
    assert merge == f'merge_maps(attributes, resource.attributes, "insert") where not IsMatch(metric.name, "^{stage}")'
    promoted = set()
    for statement in sets:
        match = re.fullmatch(r'set\(attributes\["([\w.]+)"\], resource\.attributes\["\1"\]\) where '
                             rf'IsMatch\(metric\.name, "\^{re.escape(stage)}"\) and attributes\["\1"\] == nil', statement)
        assert match, statement
        promoted.add(match.group(1))
    assert promoted == set(STAGE_RESOURCE_ATTRIBUTES)  # the same labels as on the pull endpoint


def _collector_binary():
    binary = os.environ.get("OTELCOL_BIN") or shutil.which("otelcol-contrib")
    if not binary or not os.access(binary, os.X_OK):
        pytest.skip("no OpenTelemetry Collector Contrib binary (set OTELCOL_BIN or put otelcol-contrib on PATH): "
                    "the collector config's structure is checked by the test above, not run through a collector")
    components = subprocess.run([binary, "components"], capture_output=True, text=True, timeout=60).stdout
    for needed in ("otlp", "transform", "prometheus", "memory_limiter", "batch", "health_check"):
        if not re.search(rf"^\s*- name: {needed}$", components, re.MULTILINE):
            pytest.skip(f"{binary} lacks the {needed} component that observability/otel-collector.yaml uses")
    return binary


def _scrape_labels(url, names, deadline_s=60):
    """{(metric name, frozenset of label pairs)} of the Prometheus text at ``url`` once every name is there."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                text = response.read().decode()
        except OSError:
            text = ""
        series = {}
        for line in text.splitlines():
            match = re.match(r"^([a-zA-Z_:][\w:]*)\{(.*)\} ", line)
            if match:
                labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2)))
                series.setdefault(match.group(1), []).append(labels)
        found = {name: next((v for k, v in series.items() if k.startswith(name)), None) for name in names}
        if all(found.values()):
            return found
        assert time.monotonic() < deadline, f"collector never exported {names}: {text[-3000:]}"
        time.sleep(0.5)


@pytest.mark.timeout(180)
def test_relayed_rows_keep_their_labels_through_a_real_collector(tmp_path, monkeypatch):
    binary = _collector_binary()
    grpc_port, http_port, prom_port, health_port = (_free_port() for _ in range(4))
    overrides = [f"--set=receivers::otlp::protocols::grpc::endpoint=127.0.0.1:{grpc_port}",
                 f"--set=receivers::otlp::protocols::http::endpoint=127.0.0.1:{http_port}",
                 f"--set=exporters::prometheus::endpoint=127.0.0.1:{prom_port}",
                 f"--set=extensions::health_check::endpoint=127.0.0.1:{health_port}"]
    log = open(tmp_path / "collector.log", "w")
    collector = subprocess.Popen([binary, f"--config={STACK / 'otel-collector.yaml'}", *overrides],
                                 stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:  # the health check answers once the pipelines run
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{health_port}/", timeout=2)
                break
            except OSError:
                assert collector.poll() is None, (tmp_path / "collector.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "collector did not become healthy"
                time.sleep(0.5)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{grpc_port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        handle = tel.setup_telemetry(tel.TelemetryConfig(enabled=True, traces_enabled=False, run_id="run7"), 1, 2,
                                     {k: v for k, v in SENDER.items() if k not in ("service.name", "service.instance.id",
                                                                                    "nemo.run.id")})
        tel.record_training_metrics(handle.meter, loss=2.5)
        tel.record_training_metrics(handle.meter, attributes=RELAYED_ROW, step_total_ms=40.0)
        tel.record_training_metrics(handle.meter, attributes={"dl.pipeline_parallel.rank": 0}, straggler_gap_ms=3.0)
        handle.snapshot_metrics()
        assert handle.force_flush(10000)
        handle.shutdown(timeout_ms=5000)
        found = _scrape_labels(f"http://127.0.0.1:{prom_port}/metrics",
                               ["megatron_training_loss", "megatron_training_step_total_ms",
                                "megatron_training_straggler_gap_ms"])
    finally:
        collector.terminate()
        try:
            collector.wait(timeout=20)
        except subprocess.TimeoutExpired:
            collector.kill()
            collector.wait()
    (row,) = found["megatron_training_step_total_ms"]
    assert (row["dl_rank"], row["dl_pipeline_parallel_rank"], row["service_instance_id"]) == ("0", "0", "run7-rank0")
    assert row["nemo_run_id"] == "run7" and row["host_name"] == "node-b"  # what the row lacked is promoted
    (loss,) = found["megatron_training_loss"]
    assert (loss["dl_rank"], loss["dl_pipeline_parallel_rank"], loss["nemo_run_id"]) == ("1", "1", "run7")
    (gap,) = found["megatron_training_straggler_gap_ms"]
    assert gap["dl_pipeline_parallel_rank"] == "0" and gap["nemo_run_id"] == "run7"
    assert not set(RANK_LABELS) & set(gap), gap  # a stage's series names no rank


# ---------------------------------------------------------------------------------------- pull endpoint
def test_pull_endpoint_labels_stage_series_with_the_stage_only():
    pytest.importorskip("opentelemetry.exporter.prometheus", reason="the pull endpoint needs the [prometheus] extra")
    port = _free_port()
    config = tel.TelemetryConfig(enabled=True, traces_enabled=False, metrics_exporter="prometheus",
                                 prometheus_port=port, run_id="run7")
    resource = {k: v for k, v in SENDER.items() if k != "service.instance.id"}
    resource["dl.local_rank"] = 0  # the endpoint's port is prometheus_port + local rank
    handle = tel.setup_telemetry(config, 1, 2, resource)
    try:
        tel.record_training_metrics(handle.meter, attributes=RELAYED_ROW, step_total_ms=40.0)
        tel.record_training_metrics(handle.meter, attributes={"dl.pipeline_parallel.rank": 0}, straggler_gap_ms=3.0,
                                    straggler_slowest_rank=0)
        found = _scrape_labels(f"http://127.0.0.1:{port}/metrics",
                               ["megatron_training_step_total_ms", "megatron_training_straggler_gap_ms",
                                "megatron_training_straggler_slowest_rank"], deadline_s=20)
    finally:
        handle.shutdown(timeout_ms=2000)
    (row,) = found["megatron_training_step_total_ms"]
    assert (row["dl_rank"], row["dl_pipeline_parallel_rank"], row["service_instance_id"]) == ("0", "0", "run7-rank0")
    for name in ("megatron_training_straggler_gap_ms", "megatron_training_straggler_slowest_rank"):
        (stage,) = found[name]
        assert stage["dl_pipeline_parallel_rank"] == "0" and stage["nemo_run_id"] == "run7"
        assert stage["service_name"] == "megatron-lm"
        assert not set(RANK_LABELS) & set(stage), stage


# ------------------------------------------------------------------------------------------ compose stack
def test_compose_prometheus_and_documented_commands_agree():
    compose = yaml.safe_load((STACK / "compose.yaml").read_text())
    prometheus = yaml.safe_load((STACK / "prometheus.yml").read_text())
    collector = _collector()
    readme = (STACK / "README.md").read_text()
    services = compose["services"]
    for service in services.values():  # every mounted file ships with the stack
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            assert (STACK / source).exists(), volume
    # OTLP: the published ports are the receiver's, and the documented endpoint uses the gRPC one.
    published = {int(p.split(":")[0]) for p in services["otel-collector"]["ports"]}
    receiver_ports = {int(v["endpoint"].rsplit(":", 1)[1]) for v in collector["receivers"]["otlp"]["protocols"].values()}
    assert receiver_ports <= published
    assert "OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4317" in readme and 4317 in receiver_ports
    # Push: Prometheus scrapes the collector's exporter by its service name and port.
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    exporter_port = collector["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    assert jobs["otel-collector"]["static_configs"][0]["targets"] == [f"otel-collector:{exporter_port}"]
    # Pull: the container reaches the host's bridge address as host.docker.internal, and the ranks of the
    # documented command listen there (not on the default 127.0.0.1, which a container cannot reach).
    assert "host.docker.internal:host-gateway" in services["prometheus"]["extra_hosts"]
    targets = jobs["megatron-pull"]["static_configs"][0]["targets"]
    default = tel.TelemetryConfig()
    assert default.prometheus_host == "127.0.0.1"  # safe unless the user opts in
    assert targets == [f"host.docker.internal:{default.prometheus_port + i}" for i in range(len(targets))]
    bridge = ("MEGATRON_OTEL_PROMETHEUS_HOST=$(docker network inspect bridge --format "
              "'{{(index .IPAM.Config 0).Gateway}}')")
    block = re.search(r"```\n(docker compose -f observability/compose.yaml up -d\n.*?)```", readme, re.DOTALL)
    assert block, "README.md lost its pull-mode command"
    command = block.group(1)
    assert bridge in command and "MEGATRON_OTEL_METRICS_EXPORTER=prometheus" in command
    assert f"--nproc-per-node {len(targets)}" in command  # one scrape target per local rank
    assert bridge in (STACK / "compose.yaml").read_text()  # the compose file's own instructions say the same
    # Grafana reads the prometheus service on its published port.
    datasources = yaml.safe_load((STACK / "grafana" / "provisioning" / "datasources" / "datasources.yaml").read_text())
    prometheus_port = int(services["prometheus"]["ports"][0].split(":")[0])
    assert {d["url"] for d in datasources["datasources"] if d["type"] == "prometheus"} == {
        f"http://prometheus:{prometheus_port}"}
