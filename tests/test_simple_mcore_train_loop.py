"""examples/run_simple_mcore_train_loop.py (named by Megatron's observability docs) trains on megatron.core
alone and, with MEGATRON_OTEL_ENABLED=1 MEGATRON_OTEL_EXPORTER=console, prints its spans and metrics as JSON."""
import os
import re
import subprocess
import sys

import pytest

from dist_utils import free_port
from pretrain_utils import REPO, console_objects


@pytest.mark.timeout(400)
def test_simple_mcore_train_loop_with_console_telemetry():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_"))}
    env.update(MEGATRON_OTEL_ENABLED="1", MEGATRON_OTEL_EXPORTER="console", MEGATRON_OTEL_SPAN_GROUPS="per_step",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "examples/run_simple_mcore_train_loop.py", "--iters", "4"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=360)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    losses = [float(m.group(1)) for m in re.finditer(r"iteration +\d+/4 \| lm loss: (\S+)", run.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0]  # it trains
    records = console_objects(run.stdout)
    spans = [r for r in records if "context" in r and "name" in r]
    names = [s["name"] for s in spans]
    assert names.count("megatron.train_step") == 4 and names.count("megatron.train") == 1
    assert names.count("megatron.optimizer_step") == 4
    train = next(s for s in spans if s["name"] == "megatron.train")
    assert all(s["parent_id"] == train["context"]["span_id"] for s in spans if s["name"] == "megatron.train_step")
    exported = [p["value"] for r in records for rm in r.get("resource_metrics", []) for sm in rm["scope_metrics"]
                for m in sm["metrics"] if m["name"] == "megatron.training.loss" for p in m["data"]["data_points"]]
    assert exported and exported[-1] == pytest.approx(losses[-1], rel=1e-5)
