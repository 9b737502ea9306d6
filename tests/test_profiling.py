"""Megatron's profiling flags on a real pretrain_gpt.py run: the torch.profiler trace of the chosen iterations under
--tensorboard-dir, the step spans naming it, the CPU lines of --profile (nsys) and --record-memory-history, and the
one-line flag errors."""
import importlib.util
import json
import re
import subprocess
import sys

import pytest

from pretrain_utils import REPO, console_objects, run_pretrain

pytestmark = pytest.mark.timeout(240)


def test_pytorch_profiler_trace_of_steps_3_and_4_under_tensorboard_dir(shared_data, shakespeare_prefix, tmp_path,
                                                                        monkeypatch):
    """--profile --use-pytorch-profiler --profile-step-start 3 --profile-step-end 5: one Chrome trace in
    --tensorboard-dir holding the profiler steps 3 and 4 (Megatron's schedule records [start, end)), named
    by the step spans of exactly those iterations; --record-memory-history on CPU says it needs CUDA in one
    line and the run goes on."""
    monkeypatch.setenv("MEGATRON_OTEL_ENABLED", "1")
    monkeypatch.setenv("MEGATRON_OTEL_EXPORTER", "console")
    monkeypatch.setenv("MEGATRON_OTEL_SPAN_GROUPS", "per_step")
    tensorboard = tmp_path / "tb"
    out = run_pretrain(1, ["--micro-batch-size", "4", "--train-iters", "6", "--eval-interval", "100",
                           "--profile", "--use-pytorch-profiler", "--profile-step-start", "3",
                           "--profile-step-end", "5", "--tensorboard-dir", str(tensorboard),
                           "--record-memory-history"], shared_data, shakespeare_prefix, tmp_path)
    traces = sorted(tensorboard.glob("*.pt.trace.json"))
    assert len(traces) == 1, sorted(p.name for p in tensorboard.iterdir())
    trace = json.loads(traces[0].read_text())
    events = trace["traceEvents"]
    assert len(events) > 100
    steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
    assert steps == ["ProfilerStep#3", "ProfilerStep#4"]
    assert any("train_step" in e.get("name", "") for e in events)  # with_stack=True: Python frames
    step_spans = {s["attributes"]["megatron.iteration"]: s["attributes"]
                  for s in console_objects(out) if s.get("name") == "megatron.train_step"}
    assert sorted(step_spans) == [1, 2, 3, 4, 5, 6]
    named = {it: attrs.get("megatron.profile.trace_file") for it, attrs in step_spans.items()}
    assert named == {1: None, 2: None, 3: traces[0].name, 4: traces[0].name, 5: None, 6: None}
    assert "--record-memory-history needs CUDA: no memory history is recorded on this machine" in out
    if importlib.util.find_spec("matplotlib") is None:
        return  # the report part needs the [report] extra (in [dev]); tests/test_telemetry_report.py skips likewise
    # tools/telemetry_report.py lists the profiled iterations and their trace
    log = tmp_path / "run.log"
    log.write_text(out)
    subprocess.run([sys.executable, "tools/telemetry_report.py", str(log), "-o", str(tmp_path / "r.html")], cwd=REPO,
                   check=True, capture_output=True, timeout=120)
    page = (tmp_path / "r.html").read_text()
    data = json.loads(re.search(r'id="report-data">(.*?)</script>', page, re.S).group(1))
    assert data["profiles"] == [{"iteration": 3, "rank": 0, "trace_file": traces[0].name},
                                {"iteration": 4, "rank": 0, "trace_file": traces[0].name}]
    assert not (tmp_path / "snapshot.pickle").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU line; with CUDA the nsys range opens")
def test_profile_without_pytorch_profiler_on_cpu_says_nsys_needs_cuda(shared_data, shakespeare_prefix, tmp_path):
    out = run_pretrain(1, ["--micro-batch-size", "4", "--train-iters", "3", "--eval-interval", "100", "--profile",
                           "--profile-step-start", "0", "--profile-step-end", "1"],
                       shared_data, shakespeare_prefix, tmp_path)
    assert ("[rank 0] --profile without --use-pytorch-profiler opens the CUDA profiler range for nsys, which needs "
            "CUDA: nothing is profiled") in out
    assert " iteration        3/       3 |" in out


@pytest.mark.parametrize("flags, line", [
    (["--profile", "--use-pytorch-profiler"],
     "--use-pytorch-profiler writes its trace under --tensorboard-dir: set --tensorboard-dir"),
    (["--profile", "--profile-step-start", "4", "--profile-step-end", "4"],
     "--profile-step-end (4) must be greater than --profile-step-start (4)"),
    (["--profile", "--profile-ranks", "0", "5"], "--profile-ranks 5: not a rank of this job (world size 2)"),
])
def test_profile_flag_errors_are_one_line(flags, line, monkeypatch):
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
            "--micro-batch-size 4 --global-batch-size 8 --lr 1e-3 --train-iters 5 --mock-data "
            "--tokenizer-type NullTokenizer --vocab-size 100").split()
    with pytest.raises(ValueError) as error:
        validate_args(parse_args(args=base + flags))
    assert line in str(error.value) and "\n" not in str(error.value)


def test_profile_flags_are_megatrons_and_reach_the_profiling_config(monkeypatch):
    from megatron.training.argument_utils import profiling_config_from_args
    from megatron.training.arguments import parse_args

    defaults = profiling_config_from_args(parse_args(args=["--num-layers", "2"]))
    assert (defaults.profile, defaults.profile_step_start, defaults.profile_step_end, defaults.profile_ranks,
            defaults.use_pytorch_profiler, defaults.record_memory_history, defaults.memory_snapshot_path) == (
        False, 10, 12, [0], False, False, "snapshot.pickle")
    given = profiling_config_from_args(parse_args(args=["--profile-ranks", "0", "1", "--memory-snapshot-path", "m.pkl"]))
    assert given.profile_ranks == [0, 1] and given.memory_snapshot_path == "m.pkl"


def test_pytorch_profiler_flag_without_profile_says_it_does_nothing(capsys):
    from megatron.training.config.profiling_config import ProfilingConfig
    from megatron.training.profiling import RunProfiler

    RunProfiler(ProfilingConfig(use_pytorch_profiler=True), None, rank=0, last_rank=True)
    assert "--use-pytorch-profiler has no effect without --profile" in capsys.readouterr().out
    RunProfiler(ProfilingConfig(use_pytorch_profiler=True, profile=True), "/nonexistent", rank=1, last_rank=False)
    RunProfiler(ProfilingConfig(), None, rank=0, last_rank=True)
    assert "no effect" not in capsys.readouterr().out
