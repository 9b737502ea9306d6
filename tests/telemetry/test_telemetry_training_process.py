"""The real training process (pretrain_gpt.py, one CPU rank): with telemetry off it imports no
OpenTelemetry module and makes no NVML call; an exporting rank initialises NVML exactly once."""
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pretrain_utils import console_objects

REPO = Path(__file__).resolve().parents[2]

FAKE_PYNVML = textwrap.dedent('''
    """Stand-in for pynvml that logs every call (the test machine has no GPU driver)."""
    import os

    def _log(name):
        with open(os.environ["FAKE_NVML_LOG"], "a") as f:
            f.write(name + "\\n")

    def nvmlInit(): _log("nvmlInit")
    def nvmlShutdown(): _log("nvmlShutdown")
    def nvmlDeviceGetCount(): _log("nvmlDeviceGetCount"); return 2
    def nvmlDeviceGetHandleByIndex(i): _log("nvmlDeviceGetHandleByIndex"); return i
    def nvmlDeviceGetName(h): _log("nvmlDeviceGetName"); return b"Fake GPU"
    def nvmlDeviceGetUUID(h): _log("nvmlDeviceGetUUID"); return "GPU-%d" % h
''')

RUNNER = textwrap.dedent('''
    """Run pretrain_gpt.py in this process and record the OpenTelemetry modules loaded by its end."""
    import atexit, json, os, runpy, sys

    def dump():
        with open(os.environ["MODULES_OUT"], "w") as f:
            json.dump(sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"), f)

    atexit.register(dump)
    sys.argv = ["pretrain_gpt.py"] + sys.argv[1:]
    runpy.run_path("pretrain_gpt.py", run_name="__main__")
''')

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
         "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "128", "--distributed-backend", "gloo", "--log-interval", "1", "--eval-iters", "0"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(tmp_path, name, env_extra, flags=()):
    (tmp_path / "fake").mkdir(exist_ok=True)
    (tmp_path / "fake" / "pynvml.py").write_text(FAKE_PYNVML)
    (tmp_path / "runner.py").write_text(RUNNER)
    nvml_log, modules_out = tmp_path / f"{name}.nvml", tmp_path / f"{name}.modules.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path / "fake"), str(REPO), env.get("PYTHONPATH", "")]),
               FAKE_NVML_LOG=str(nvml_log), MODULES_OUT=str(modules_out), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(env_extra)
    proc = subprocess.run([sys.executable, str(tmp_path / "runner.py"), *FLAGS, *flags], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "iteration        1/       1" in proc.stdout
    calls = nvml_log.read_text().split() if nvml_log.exists() else []
    return json.loads(modules_out.read_text()), calls, proc.stdout


@pytest.mark.timeout(600)
def test_disabled_imports_no_opentelemetry_and_exporting_rank_probes_nvml_once(tmp_path):
    modules, calls, _ = _train(tmp_path, "off", {"MEGATRON_OTEL_ENABLED": "0"},
                               ["--save", str(tmp_path / "ckpt"), "--save-interval", "1"])
    assert modules == [] and calls == []
    modules, calls, stdout = _train(tmp_path, "on", {"MEGATRON_OTEL_ENABLED": "1", "MEGATRON_OTEL_EXPORTER": "console",
                                                     "MEGATRON_OTEL_METRICS_ENABLED": "0"})
    assert any(m.startswith("opentelemetry.sdk") for m in modules)
    assert calls.count("nvmlInit") == 1, calls
    spans = [obj for obj in console_objects(stdout) if "context" in obj]
    resource = spans[0]["resource"]["attributes"]
    assert resource["host.gpu.count"] == 2 and resource["dl.gpu.uuid"] == "GPU-0"
