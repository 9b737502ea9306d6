"""The paired telemetry benchmark measures what it says: its on/off plan, and a real run in which off iterations export nothing."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import bench_telemetry  # noqa: E402
from pretrain_utils import console_objects  # noqa: E402
from telemetry_toggle import PREFIX, iteration_plan  # noqa: E402


@pytest.mark.parametrize("interval", [3, 5, 7])
def test_plan_pairs_one_on_with_one_off_and_alternates_the_order(interval):
    warmup, intervals = 2, 8
    plan = {t: iteration_plan(t, interval, warmup) for t in range(1, interval * (warmup + intervals) + 1)}
    assert all(plan[t] == (True, "warmup", -1) for t in range(1, warmup * interval + 1))
    for kind, expected_pairs in (("nonlog", intervals * (interval - 1) // 2), ("log", intervals // 2)):
        pairs = {}
        for t, (on, k, pair) in plan.items():
            if k == kind:
                pairs.setdefault(pair, []).append((t, on))
        assert len(pairs) == expected_pairs
        firsts = []
        for members in pairs.values():
            assert sorted(on for _, on in members) == [False, True]  # one on, one off
            firsts.append(min(members)[1])
        assert firsts[0::2] == [True] * len(firsts[0::2]) and firsts[1::2] == [False] * len(firsts[1::2])
    log_iterations = {t for t, (_, k, _) in plan.items() if k == "log"}
    assert log_iterations == {t for t in plan if t > warmup * interval and t % interval == 0}


def test_ratio_of_identical_sides_is_one_and_the_background_is_charged_to_on():
    record = {"log_interval": 5, "on_iterations": 10, "off_iterations": 10, "extra_cpu_ms": 30.0}
    for kind in ("nonlog", "log"):
        for side in ("on", "off"):
            for clock in ("wall", "cpu"):
                record[f"{kind}_{side}_{clock}_ms"] = [100.0, 110.0, 90.0] if kind == "nonlog" else [120.0, 130.0]
    r = bench_telemetry._ratios(record, resamples=50, background_per_iter=0.5)
    assert r["wall"][2] == pytest.approx(1.0) and r["wall"][3] == pytest.approx(1.0)
    # 30 ms off the training thread, 0.5 ms/iter x 20 iterations of it also in a disabled run: 20 ms over 10 on.
    on, off = r["cpu"][0], r["cpu"][1]
    assert on - off == pytest.approx(2.0)


@pytest.mark.timeout(300)
def test_off_iterations_emit_no_span_and_no_metric_snapshot():
    interval, warmup, intervals = 3, 2, 4
    iters = interval * (warmup + intervals)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_OTEL_", "OTEL_", "NEMO_LENS_"))}
    env.update(MEGATRON_OTEL_ENABLED="1", MEGATRON_OTEL_EXPORTER="console", MEGATRON_OTEL_SPAN_GROUPS="per_step",
               OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), BENCH_WARMUP_INTERVALS=str(warmup))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           str(REPO / "bench" / "telemetry_toggle.py"), "--num-layers", "1", "--hidden-size", "32",
           "--num-attention-heads", "2", "--seq-length", "32", "--max-position-embeddings", "32",
           "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(iters), "--log-interval",
           str(interval), "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
           "--eval-iters", "0", "--distributed-backend", "gloo", "--num-workers", "0", "--seed", "1234"]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    record = json.loads(next(line for line in lines if line.startswith(PREFIX))[len(PREFIX):])
    assert len(record["nonlog_on_wall_ms"]) == intervals * (interval - 1) // 2
    assert len(record["log_on_wall_ms"]) == intervals // 2
    assert record["on_iterations"] == record["off_iterations"] == intervals * interval // 2
    assert all(v > 0 for key, values in record.items() if key.endswith("_ms") and isinstance(values, list)
               for v in values)

    on_iterations = {t for t in range(1, iters + 1) if iteration_plan(t, interval, warmup)[0]}
    objs = console_objects(result.stdout)
    steps = {o["attributes"]["megatron.iteration"] for o in objs if o.get("name") == "megatron.train_step"}
    assert steps == on_iterations
    data_loading = sum(1 for o in objs if o.get("name") == "megatron.data_loading")
    assert data_loading == 2 * len(on_iterations)  # two micro-batches per iteration
    # Metric snapshots are taken on log iterations with telemetry on only (and the final flush).
    logged = set()
    for o in objs:
        for rm in o.get("resource_metrics", []):
            for sm in rm["scope_metrics"]:
                for metric in sm["metrics"]:
                    if metric["name"] == "megatron.training.iteration":
                        logged.update(int(p["value"]) for p in metric["data"]["data_points"])
    on_logs = {t for t in on_iterations if t % interval == 0 or t == 1}
    assert logged == on_logs
