"""The older example scripts run in CI with tiny CPU settings and their own checks pass: quickstart.py (corpus ->
SentencePiece -> .bin/.idx -> training), gpt2_shakespeare.sh (DP=2 == DP=1, exact resume) and gpt2_shakespeare_tp.sh
(TP=2, TP=2+SP, TP=2 x DP=2 == TP=1) and gpt2_shakespeare_pp.sh (PP=2, PP=2 x TP=2 == PP=1). The GPT-3 small launch examples are run by tests/test_launch_examples.py."""
import os
import subprocess
import sys

import pytest

from pretrain_utils import REPO, losses_from_log

TINY = dict(NUM_LAYERS="2", HIDDEN_SIZE="32", SEQ_LENGTH="32", MICRO_BATCH_SIZE="2", GLOBAL_BATCH_SIZE="4",
            WARMUP_ITERS="1", EVAL_INTERVAL="2", EVAL_ITERS="1")


def _run(argv, env_overrides, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_overrides)
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


@pytest.mark.timeout(300)
def test_quickstart_tiny(tmp_path):
    out = _run([sys.executable, "examples/quickstart.py", "--out", str(tmp_path), "--corpus-mb", "0.05",
                "--vocab-size", "600", "--train-iters", "3", "--nproc", "1"], {}, timeout=280)
    assert sorted(losses_from_log(out)) == [1, 2, 3]
    assert (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert list((tmp_path / "tensorboard").iterdir())


@pytest.mark.timeout(600)
def test_gpt2_shakespeare_tiny(shared_data, tmp_path):
    _run(["bash", "examples/gpt2_shakespeare.sh", str(tmp_path)],
         dict(TINY, SHARED=str(shared_data), ITERS="4", RESUME_AT="2", LOG_INTERVAL="1", LOSS_BELOW="11"), timeout=580)
    dp2 = losses_from_log((tmp_path / "dp2.log").read_text())
    assert sorted(dp2) == [1, 2, 3, 4] and dp2 == losses_from_log((tmp_path / "dp1.log").read_text())
    assert sorted(losses_from_log((tmp_path / "resumed.log").read_text())) == [3, 4]


@pytest.mark.timeout(600)
def test_gpt2_shakespeare_tp_tiny(shared_data, tmp_path):
    out = _run(["bash", "examples/gpt2_shakespeare_tp.sh", str(tmp_path)], dict(TINY, SHARED=str(shared_data), ITERS="3"),
               timeout=580)
    assert "logged the TP=1 losses at every iteration" in out
    for run in ("tp1", "tp2", "tp2_sp", "tp2_dp2"):
        assert sorted(losses_from_log((tmp_path / f"{run}.log").read_text())) == [1, 2, 3], run


@pytest.mark.timeout(600)
def test_gpt2_shakespeare_pp_tiny(shared_data, tmp_path):
    out = _run(["bash", "examples/gpt2_shakespeare_pp.sh", str(tmp_path)], dict(TINY, SHARED=str(shared_data), ITERS="3"),
               timeout=580)
    assert "logged the PP=1 losses at every iteration" in out
    for run in ("pp1", "pp2", "pp2_tp2"):
        assert sorted(losses_from_log((tmp_path / f"{run}.log").read_text())) == [1, 2, 3], run
