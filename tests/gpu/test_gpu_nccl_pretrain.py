"""pretrain_gpt.py over NCCL under torchrun: timers, loss reductions, evaluation, checkpoint save and load.

Every collective of the training loop (the timers' min/max gather, the loss and grad-norm
reductions, the checkpoint agreement after save and load, the data broadcast) must use tensors on
the device NCCL serves; gloo accepts CPU tensors, so only a run over NCCL can show a wrong choice.
"""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_utils import requires_cuda

pytestmark = requires_cuda

REPO = Path(__file__).resolve().parents[2]
ITERATION = re.compile(r"\biteration\s+(\d+)/\s*\d+ \|.*\| lm loss: ([-+0-9.Ee]+) \|")


def _pretrain(nproc, flags, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "pretrain_gpt.py", "--distributed-backend", "nccl", "--bf16",
           "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
           "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "8",
           "--lr", "1e-3", "--log-interval", "1", "--timing-log-level", "2", "--log-throughput",
           "--eval-interval", "2", "--eval-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
           "--vocab-size", "1024", *flags]
    result = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True,
                            text=True, timeout=timeout)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    return out


def _losses(out):
    losses = {int(m.group(1)): float(m.group(2)) for m in ITERATION.finditer(out)}
    assert all(math.isfinite(v) and v > 0 for v in losses.values()), losses
    return losses


@pytest.mark.parametrize("nproc", [1, 2])
def test_train_eval_save_load_over_nccl(nproc, tmp_path):
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs, this machine has {torch.cuda.device_count()}")
    ckpt = str(tmp_path / "ckpt")
    first = _pretrain(nproc, ["--train-iters", "6", "--save", ckpt, "--save-interval", "2", "--exit-interval", "4"])
    assert sorted(_losses(first)) == [1, 2, 3, 4]
    assert "(min, max) time across ranks (ms):" in first  # timers gathered over the NCCL group
    assert "forward-backward" in first
    assert " validation loss at iteration 4 | lm loss value:" in first  # eval-loss reduction
    assert "successfully saved checkpoint from iteration       4" in first
    assert (Path(ckpt) / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    resumed = _pretrain(nproc, ["--train-iters", "6", "--load", ckpt])
    assert "successfully loaded checkpoint" in resumed and "at iteration 4" in resumed
    assert sorted(_losses(resumed)) == [5, 6]
    assert " validation loss at iteration 6 on test set | lm loss value:" in resumed
