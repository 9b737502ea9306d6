"""--rampup-batch-size end to end: the logged global batch grows, DP=2 equals DP=1, resume is exact."""
import re
from pathlib import Path

import pytest

from pretrain_utils import losses_from_log, run_pretrain

# start 4, increment 4, final 12 over 24 samples: one increment every 12 samples, so iterations see
# consumed 0, 4, 8 -> 4; 12, 20 -> 8; 28 > 24 -> 12 (then 40, 52, 64). 64 samples = 8 iterations.
RAMP = ["--global-batch-size", "12", "--rampup-batch-size", "4", "4", "24", "--train-samples", "64",
        "--hidden-dropout", "0", "--attention-dropout", "0"]
EXPECTED_BATCHES = [4, 4, 4, 8, 8, 12, 12, 12]
EXPECTED_CONSUMED = [4, 8, 12, 20, 28, 40, 52, 64]


def _batches(stdout):
    """{iteration: (global batch size, consumed samples)} from the log lines."""
    found = {}
    for line in stdout.splitlines():
        match = re.search(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|.* global batch size:\s+(\d+) \|",
                          line)
        if match:
            found[int(match.group(1))] = (int(match.group(3)), int(match.group(2)))
    return found


def test_rampup_grows_the_batch_matches_dp1_and_resumes_exactly(shared_data, shakespeare_prefix, tmp_path):
    ckpt = str(tmp_path / "ckpt")  # saved at iterations 4 and 8, for the resume below
    full_out = run_pretrain(2, ["--micro-batch-size", "2", *RAMP, "--save", ckpt, "--save-interval", "4"],
                            shared_data, shakespeare_prefix, tmp_path)
    full = losses_from_log(full_out)
    assert sorted(full) == list(range(1, 9))
    assert _batches(full_out) == {it + 1: (b, c) for it, (b, c) in enumerate(zip(EXPECTED_BATCHES, EXPECTED_CONSUMED))}
    # The LR schedule counts samples: after exactly --train-samples it reaches --min-lr.
    assert "iteration        8/       8" in full_out and "learning rate: 1.000000E-04" in full_out.splitlines()[
        [i for i, line in enumerate(full_out.splitlines()) if "iteration        8/" in line][0]]

    # One rank with 2, 2, 4, 4, 6, ... microbatches of 2 reads the same samples as two ranks with 1, 1, 2, ...
    dp1 = losses_from_log(run_pretrain(1, ["--micro-batch-size", "2", *RAMP], shared_data, shakespeare_prefix,
                                       tmp_path))
    for it in full:
        assert float(dp1[it]) == pytest.approx(float(full[it]), rel=1e-5), f"iteration {it}"

    # Resume mid-ramp (from iteration 4, 20 samples consumed, the next batch is 8).
    assert (Path(ckpt) / "iter_0000004").is_dir()
    resumed_out = run_pretrain(2, ["--micro-batch-size", "2", *RAMP, "--load", ckpt, "--ckpt-step", "4"],
                               shared_data, shakespeare_prefix, tmp_path)
    resumed = losses_from_log(resumed_out)
    assert sorted(resumed) == [5, 6, 7, 8]
    assert resumed == {it: full[it] for it in resumed}
    assert _batches(resumed_out) == {it: _batches(full_out)[it] for it in resumed}


def test_rampup_with_iteration_based_training_is_refused_at_start_up(shared_data, shakespeare_prefix, tmp_path):
    out = run_pretrain(1, ["--micro-batch-size", "2", "--rampup-batch-size", "4", "4", "24", "--train-iters", "4"],
                       shared_data, shakespeare_prefix, tmp_path, expect_failure=True)
    assert "--rampup-batch-size needs sample-based training: use --train-samples" in out
    assert "building GPT model" not in out


@pytest.mark.parametrize("rampup,gbs,train_samples,iterations", [
    ([4, 4, 24], 12, 64, 8),   # 4, 4, 4, 8, 8, then 12 x 3 = 64 exactly
    ([4, 4, 24], 12, 63, 7),   # the 8th batch (12) would pass 63: dropped
    ([4, 4, 24], 12, 10, 2),   # stops inside the ramp: 4 + 4, the next 4 does not fit
    (None, 8, 40, 5),
    (None, 8, 47, 5),
])
def test_train_iters_for_samples_follows_the_ramp(rampup, gbs, train_samples, iterations):
    from types import SimpleNamespace

    from megatron.training.training import train_iters_for_samples

    args = SimpleNamespace(rampup_batch_size=rampup, global_batch_size=gbs, micro_batch_size=2, data_parallel_size=2,
                           decrease_batch_size_if_needed=False, train_samples=train_samples)
    assert train_iters_for_samples(args) == iterations
