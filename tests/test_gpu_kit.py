"""The GPU kit stays runnable: bench/gpu.sh --dry-run end to end on the CPU, its log parsing, the wheel helper."""
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu_check  # noqa: E402
import gpu_wheels  # noqa: E402

# Every stage a dry run must pass, and the figures each one must report.
DRY_RUN_FIGURES = {
    "env": ["gpu_count", "peak_bf16_tflops"],
    "gpu_tests": ["gpu_tests_passed", "gpu_tests_skipped", "gpu_tests_failed"],
    "resume": ["resume_iterations_compared", "resume_max_rel_diff"],
    "telemetry": ["telemetry_spans", "telemetry_train_step_spans", "telemetry_max_rel_loss_diff"],
    "mfu": ["mfu_model_params", "mfu_micro_batch_size", "mfu_global_batch_size", "mfu_step_time_ms",
            "mfu_tokens_per_sec", "mfu_tflops_per_gpu", "mfu", "mfu_theoretical_activation_mb",
            "mfu_theoretical_total_mb"],
    "profile": ["profile_table_rows", "profile_table_bytes"],
    "parallel": ["parallel_iterations_compared", "tp2_fp32_max_rel_loss_diff", "tp2_bf16_max_rel_loss_diff",
                 "dp2_bf16_max_rel_loss_diff"],
    "parallel_pp": ["parallel_pp_iterations_compared", "pp2_max_rel_loss_diff"],
    "parallel_cp": ["parallel_cp_iterations_compared"] + [
        f"cp2_{c}_{figure}" for c in gpu_check.CP_COMM_TYPES
        for figure in ("max_rel_loss_diff", "tokens_per_sec", "tokens_per_sec_ratio_to_1gpu")],
    "dp_distopt": ["dp_distopt_max_rel_loss_diff", "dp_distopt_weight_and_optimizer_mb", "dp_distopt_step_time_ms",
                   "dp_distopt_step_time_ratio_to_dp2"],
    "async_save_2gpu": ["async_save_2gpu_iterations_compared", "async_save_2gpu_max_rel_diff"],
}


def test_dry_run_passes_every_stage_and_reports_every_figure(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(["bash", "bench/gpu.sh", "--dry-run", "--out", str(out), "--work-dir", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["dry_run"] is True and doc["ok"] is True
    stages, figures = doc["stages"], doc["figures"]
    for stage, names in DRY_RUN_FIGURES.items():
        assert stages[stage]["status"] == "passed", (stage, stages[stage])
        for name in names:
            assert name in figures and figures[name]["value"] is not None, (stage, name)
            value, unit = figures[name]["value"], figures[name]["unit"]
            assert f"\n{name}: {value} {unit}\n" in result.stdout  # one printed line per figure
    # The measurements run first: the MFU stage right after env.
    assert list(stages)[:4] == ["env", "mfu", "mfu_fused", "profile"]
    # The cuDNN and compile measurements are not run on the CPU; they say why.
    for stage in ("mfu_fused", "mfu_compile"):
        assert stages[stage]["status"] == "skipped" and stages[stage]["detail"]
    # What was measured is what the checks claim.
    assert figures["gpu_tests_passed"]["value"] == 0 and figures["gpu_tests_skipped"]["value"] >= 7
    assert figures["resume_max_rel_diff"]["value"] == 0.0  # the CPU resumes exactly
    iterations = gpu_check.small_model(dry_run=True)["iters"]
    assert figures["telemetry_train_step_spans"]["value"] == iterations
    assert figures["resume_iterations_compared"]["value"] == iterations - gpu_check.small_model(dry_run=True)["half"]
    assert figures["mfu_tokens_per_sec"]["value"] > 0 and figures["peak_bf16_tflops"]["value"] == 1.0
    assert figures["tp2_fp32_max_rel_loss_diff"]["value"] <= 1e-5
    assert figures["tp2_bf16_max_rel_loss_diff"]["value"] <= 2e-3
    assert figures["dp_distopt_max_rel_loss_diff"]["value"] <= 2e-3
    from megatron.core.transformer.context_parallel import CP_COMM_TYPES

    assert gpu_check.CP_COMM_TYPES == CP_COMM_TYPES  # the stage runs every --cp-comm-type there is
    for comm_type in gpu_check.CP_COMM_TYPES:
        assert figures[f"cp2_{comm_type}_max_rel_loss_diff"]["value"] <= 2e-3
    # Resumed from the 2-rank --async-save checkpoint: exactly the uninterrupted run on the CPU.
    assert figures["async_save_2gpu_max_rel_diff"]["value"] == 0.0
    assert figures["async_save_2gpu_iterations_compared"]["value"] == iterations - gpu_check.small_model(True)["half"]
    # The memory report's activation estimate arrives; the profiler's table is one small file of 25 rows.
    assert figures["mfu_theoretical_activation_mb"]["value"] > 0
    assert figures["profile_table_rows"]["value"] == 25
    assert (out / "kernels.txt").stat().st_size == figures["profile_table_bytes"]["value"] < 16_000
    assert figures["dp_distopt_weight_and_optimizer_mb"]["value"] > 0
    assert "training ..." in (out / "gpu_check.log").read_text()  # every run's output is kept


@pytest.mark.parametrize("dry_run", [True, False])
def test_tp2_check_compares_models_of_the_same_padded_vocabulary(dry_run):
    from types import SimpleNamespace

    from megatron.core.tokenizers.null_tokenizer import NullTokenizer
    from megatron.training.tokenizer import _vocab_size_with_padding

    ids = NullTokenizer(gpu_check.small_model(dry_run)["vocab"]).vocab_size
    padded = {tp: _vocab_size_with_padding(ids, SimpleNamespace(make_vocab_size_divisible_by=128,
                                                                 tensor_model_parallel_size=tp, rank=1))
              for tp in (1, 2)}
    assert padded[1] == padded[2], padded
    assert gpu_check.PARALLEL_RTOL == {"fp32": 1e-5, "bf16": 2e-3}


def test_without_cuda_and_without_dry_run_it_stops_at_env(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the check would run for real")
    result = subprocess.run(["bash", "bench/gpu.sh", "--out", str(tmp_path), "--stages", "resume"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["stages"]["env"]["status"] == "failed" and "--dry-run" in doc["stages"]["env"]["detail"]
    assert doc["stages"]["resume"] == {"status": "failed", "seconds": 0.0, "detail": "not run: the env stage failed"}


def test_bad_options_are_refused():
    for argv, message in ((["--stages", "mfu,warp"], "unknown stage"), (["--peak-tflops", "0"], "--peak-tflops")):
        result = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", *argv], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and message in result.stderr, result.stderr


LOG = """\
 [2026-01-01 00:00:00.000000] iteration        1/      10 | consumed samples:           32 | elapsed time per iteration (ms): 2000.0 | throughput per GPU (TFLOP/s/GPU): 250.0 | learning rate: 1.000000E-04 | global batch size:    32 | lm loss: 1.082000E+01 | loss scale: 1.0 | grad norm: 5.000 | number of skipped iterations:   0 | number of nan iterations:   0 |
 [2026-01-01 00:00:01.000000] iteration        2/      10 | consumed samples:           64 | elapsed time per iteration (ms): 1000.0 | throughput per GPU (TFLOP/s/GPU): 500.5 | learning rate: 2.000000E-04 | global batch size:    32 | lm loss: 9.500000E+00 | loss scale: 1.0 | grad norm: 4.000 | number of skipped iterations:   0 | number of nan iterations:   0 |
"""


def test_parse_iterations_reads_megatron_log_line():
    lines = gpu_check.parse_iterations("noise\n" + LOG + "(min, max) time across ranks (ms):\n")
    assert sorted(lines) == [1, 2]
    assert lines[2]["throughput per GPU (TFLOP/s/GPU)"] == 500.5
    assert lines[2]["elapsed time per iteration (ms)"] == 1000.0 and lines[2]["global batch size"] == 32
    assert gpu_check.losses(LOG) == {1: 10.82, 2: 9.5}
    with pytest.raises(gpu_check.StageFailed, match="lm loss"):
        gpu_check.losses("no log line here")


def test_relative_difference_and_peaks():
    assert gpu_check.max_relative_difference({2: 9.5}, {1: 10.0, 2: 9.5}) == 0.0
    assert gpu_check.max_relative_difference({1: 10.1, 2: 9.5}, {1: 10.0, 2: 9.5}) == pytest.approx(0.01)
    with pytest.raises(gpu_check.StageFailed, match="missing"):
        gpu_check.max_relative_difference({3: 1.0}, {1: 1.0})
    assert gpu_check.peak_tflops_for("NVIDIA H200") == 989.0
    assert gpu_check.peak_tflops_for("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_check.peak_tflops_for("NVIDIA H100 PCIe") == 756.0
    assert gpu_check.peak_tflops_for("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_check.peak_tflops_for("NVIDIA GeForce RTX 4090") is None


def _fake_wheel(folder: Path, name: str, version: str, requires):
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta)
    return path


def test_wheel_requirements_are_read_and_checked(tmp_path):
    _fake_wheel(tmp_path, "demo-exporter", "1.0", [
        "pytest>=1.0", "definitely-not-installed-pkg>=1", "pytest<1.0; python_version < '3'",
        "pytest>=99; extra == 'fancy'", "pytest>=999"])
    name, version, requires = gpu_wheels.wheel_metadata(next(tmp_path.glob("*.whl")))
    assert (name, version, len(requires)) == ("demo-exporter", "1.0", 5)
    # Markers that do not hold (old python, an extra nobody asked for) are not requirements.
    assert [str(r) for r in gpu_wheels.needed_requirements(requires)] == [
        "pytest>=1.0", "definitely-not-installed-pkg>=1", "pytest>=999"]
    problems = gpu_wheels.unmet_requirements(tmp_path)
    assert len(problems) == 2
    assert "definitely-not-installed-pkg>=1: not installed" in problems[0]
    assert "pytest>=999" in problems[1] and "installed" in problems[1]


def test_pyproject_roots_are_what_the_gpu_image_lacks():
    roots = gpu_wheels.pyproject_roots()
    assert {"opentelemetry-sdk", "opentelemetry-exporter-otlp"} <= set(roots)
    assert not {"torch", "numpy", "tensorboard", "grpcio", "pytest"} & set(roots)


def test_wheel_folder_is_ignored_by_git():
    result = subprocess.run(["git", "check-ignore", "-q", ".whl/opentelemetry_sdk-1.0-py3-none-any.whl"], cwd=REPO)
    assert result.returncode == 0, ".whl/ must be in .gitignore (wheels travel with carry, not in commits)"
