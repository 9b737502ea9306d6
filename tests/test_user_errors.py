"""Errors caused by the user's input end a run with one `error: ...` line per failing rank and no traceback;
internal errors keep theirs (issue 9 item 11)."""
import pytest

from pretrain_utils import REPO, run_ranks, run_ranks_without_launcher

pytestmark = pytest.mark.timeout(600)

TRAIN = ["--micro-batch-size", "2", "--train-iters", "3"]


def _error_lines(out):
    return [line for line in out.splitlines() if "error: " in line]


def _check_one_line_per_rank(ranks, message, status):
    for rank, (exit_status, out) in enumerate(ranks):
        assert exit_status == status, f"rank {rank} exit {exit_status}: {out[-2000:]}"
        assert "Traceback" not in out, f"rank {rank}: {out[-3000:]}"
        lines = _error_lines(out)
        assert len(lines) == 1 and message in lines[0], f"rank {rank}: {out[-2000:]}"
        assert lines[0].startswith(f"[rank {rank}] error: ")


def test_bad_batch_sizes_one_line_from_rank_0_exit_2(shared_data, shakespeare_prefix, tmp_path):
    """A flag error is the same on every rank: rank 0 prints it once, every rank exits 2."""
    ranks = run_ranks_without_launcher(2, ["--micro-batch-size", "3", "--global-batch-size", "8", "--train-iters", "2"],
                                       shared_data, shakespeare_prefix, tmp_path)
    for rank, (exit_status, out) in enumerate(ranks):
        assert exit_status == 2, f"rank {rank} exit {exit_status}: {out[-2000:]}"
        assert "Traceback" not in out, f"rank {rank}: {out[-3000:]}"
    rank0_lines, rank1_lines = _error_lines(ranks[0][1]), _error_lines(ranks[1][1])
    assert len(rank0_lines) == 1 and rank0_lines[0].startswith("error: "), ranks[0][1][-2000:]
    assert "global batch size (8) is not divisible by micro batch size (3)" in rank0_lines[0]
    assert rank1_lines == [], ranks[1][1][-2000:]


def test_missing_vocab_file_one_line_per_rank(shared_data, shakespeare_prefix, tmp_path):
    ranks = run_ranks_without_launcher(2, [*TRAIN, "--vocab-file", str(tmp_path / "nope.json")], shared_data,
                                       shakespeare_prefix, tmp_path)
    _check_one_line_per_rank(ranks, f"--vocab-file: GPT-2 vocabulary (gpt2-vocab.json) not found: {tmp_path / 'nope.json'}", 1)


def test_wrong_data_path_names_the_flag_and_suggests_the_prefix(shared_data, shakespeare_prefix, tmp_path):
    """``--data-path DIR/shakes`` where ``DIR/shakes_text_document.bin`` exists: the suggestion names it."""
    stem = shakespeare_prefix[: -len("_text_document")]
    # Without torchrun, whose own error block has a traceback of the launcher.
    [(status, out)] = run_ranks_without_launcher(1, [*TRAIN, "--data-path", stem], shared_data, shakespeare_prefix,
                                                 tmp_path)
    assert status == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = _error_lines(out)
    assert len(lines) == 1, out[-3000:]
    assert lines[0].startswith("error: --data-path"), lines
    assert f"did you mean --data-path {shakespeare_prefix}?" in lines[0], lines


def test_internal_error_keeps_its_traceback(shared_data, shakespeare_prefix, tmp_path):
    """A fault that is not the user's (here a forward step that raises) is still reported with a traceback."""
    script = tmp_path / "broken_pretrain.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "import pretrain_gpt\n"
        "def forward_step(data_iterator, model):\n"
        "    raise RuntimeError('internal fault for the test')\n"
        "pretrain_gpt.forward_step = forward_step\n"
        "pretrain_gpt.main()\n"
    )
    from pretrain_utils import _pretrain_argv

    argv = _pretrain_argv(TRAIN, shared_data, shakespeare_prefix, tmp_path)[1:]
    result = run_ranks(1, [str(script), *argv], timeout=300)  # one rank, forked from the fork server
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "RuntimeError: internal fault for the test" in result.stderr


def _one_error_line(out):
    lines = _error_lines(out)
    assert "Traceback" not in out and "usage:" not in out, out[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), out[-3000:]
    return lines[0]


def test_flag_typo_one_line_with_did_you_mean_from_rank_0(shared_data, shakespeare_prefix, tmp_path):
    """Not the ~180-line usage on every rank: rank 0 prints one line naming the flag it guesses."""
    ranks = run_ranks_without_launcher(2, [*TRAIN, "--num-layer", "2"], shared_data, shakespeare_prefix, tmp_path)
    assert [status for status, _ in ranks] == [2, 2], ranks[0][1][-2000:]
    assert _one_error_line(ranks[0][1]) == "error: unrecognized arguments: --num-layer 2 (did you mean --num-layers?)"
    assert _error_lines(ranks[1][1]) == [] and "usage:" not in ranks[1][1], ranks[1][1][-2000:]


def test_bare_pretrain_gpt_lists_every_missing_required_flag(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS")}
    result = subprocess.run([sys.executable, "pretrain_gpt.py"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert _one_error_line(result.stdout + result.stderr) == (
        "error: missing required flags: --num-layers, --hidden-size, --num-attention-heads, --seq-length, "
        "--max-position-embeddings, --micro-batch-size, --train-iters (or --train-samples), --lr, "
        "--vocab-file (for --tokenizer-type GPT2BPETokenizer), --merge-file (for --tokenizer-type GPT2BPETokenizer), "
        "a data source (--data-path, --train-data-path/--valid-data-path/--test-data-path or --mock-data)")


@pytest.fixture(scope="module")
def saved_run(shared_data, shakespeare_prefix, tmp_path_factory):
    """A 2-iteration run that evaluated 15 batches after each iteration (more samples than one epoch of
    the 2 % validation split), saved at iteration 2."""
    tmp_path = tmp_path_factory.mktemp("saved_run")
    flags = [*TRAIN[:2], "--train-iters", "2", "--lr-warmup-iters", "1", "--eval-interval", "1", "--eval-iters", "15",
             "--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    [(status, out)] = run_ranks_without_launcher(1, flags, shared_data, shakespeare_prefix, tmp_path)
    assert status == 0, out[-3000:]
    return tmp_path


def test_scheduler_mismatch_is_one_line_naming_samples_and_both_flags(shared_data, shakespeare_prefix, saved_run,
                                                                      tmp_path):
    """Training on (--train-iters 4 after 2) changes the decay length: counted in samples, as the scheduler does."""
    flags = [*TRAIN[:2], "--train-iters", "4", "--lr-warmup-iters", "1", "--eval-interval", "1", "--eval-iters", "15",
             "--load", str(saved_run / "ckpt")]
    [(status, out)] = run_ranks_without_launcher(1, flags, shared_data, shakespeare_prefix, tmp_path)
    assert status == 1, out[-3000:]
    line = _one_error_line(out)
    assert line.startswith(f"error: --load {saved_run / 'ckpt'}: the checkpoint's learning-rate schedule has decay "
                           "samples (--lr-decay-iters or --train-iters x --global-batch-size, or --lr-decay-samples) "
                           "16, this run's flags give 32; pass --override-opt-param-scheduler"), line


def test_exhausted_validation_split_names_dataset_split_and_flags(shared_data, shakespeare_prefix, saved_run,
                                                                  tmp_path):
    """Resumed with flags that ask for fewer validation samples than the checkpoint consumed."""
    flags = [*TRAIN[:2], "--train-iters", "3", "--lr-warmup-iters", "1", "--eval-interval", "1000", "--eval-iters", "1",
             "--load", str(saved_run / "ckpt"), "--override-opt-param-scheduler"]
    [(status, out)] = run_ranks_without_launcher(1, flags, shared_data, shakespeare_prefix, tmp_path)
    assert status == 1, out[-3000:]
    line = _one_error_line(out)
    import re

    match = re.fullmatch(
        rf"error: no validation samples left to consume: the checkpoint of --load {re.escape(str(saved_run / 'ckpt'))} "
        rf"has consumed (\d+) validation samples of --data-path {re.escape(shakespeare_prefix)} --split 98,2,0, "
        r"this run's validation dataset holds (\d+); this run asks for 8 \(\(--train-iters 3 // --eval-interval 1000 "
        r"\+ 1\) x --eval-iters 1 x --eval-global-batch-size 8\): raise --eval-iters or lower --eval-interval to ask "
        r"for more than the checkpoint has consumed", line)
    assert match and int(match.group(1)) >= int(match.group(2)), line


def test_empty_split_is_one_line_naming_the_split_and_the_flag(shared_data, shakespeare_prefix, tmp_path):
    """A --split whose validation part rounds to no document, while evaluation asks for samples."""
    [(status, out)] = run_ranks_without_launcher(1, [*TRAIN, "--split", "999999,1,0"], shared_data,
                                                 shakespeare_prefix, tmp_path)
    assert status == 1, out[-3000:]
    line = _one_error_line(out)
    assert line.startswith(f"error: the valid split of {shakespeare_prefix} is empty"), line
    assert "change --split or use more data" in line, line


def test_checkpoint_shape_mismatch_is_one_line_naming_load_and_the_flag(shared_data, shakespeare_prefix, saved_run,
                                                                        tmp_path):
    flags = [*TRAIN[:2], "--train-iters", "2", "--lr-warmup-iters", "1", "--hidden-size", "64",
             "--load", str(saved_run / "ckpt")]
    [(status, out)] = run_ranks_without_launcher(1, flags, shared_data, shakespeare_prefix, tmp_path)
    assert status == 1, out[-3000:]
    line = _one_error_line(out)
    assert line.startswith(f"error: --load {saved_run / 'ckpt'}: "), line
    assert line.endswith("hidden_size value from checkpoint (32) is not equal to the input argument value (64) "
                         "(--hidden-size)"), line


@pytest.mark.parametrize("launcher_env", [{}, {"TORCHELASTIC_RUN_ID": "none"}, {"SLURM_STEP_ID": "0"}],
                         ids=["no-launcher", "torchrun", "srun"])
def test_silent_rank_waits_for_rank_0_only_under_a_launcher_that_stops_it(launcher_env, monkeypatch):
    """Rank 1 leaves an every-rank error to rank 0; it waits before exiting only where a launcher would stop
    rank 0 as soon as rank 1 exits (waiting elsewhere only delays the exit)."""
    from megatron.training import user_errors

    for name in ("TORCHELASTIC_RUN_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", **launcher_env}.items():
        monkeypatch.setenv(name, value)
    slept = []
    monkeypatch.setattr(user_errors.time, "sleep", slept.append)
    with pytest.raises(SystemExit) as exit_info:
        user_errors.report_and_exit(user_errors.UserInputError("bad flag", exit_status=2, same_on_every_rank=True))
    assert exit_info.value.code == 2
    assert slept == ([user_errors._SILENT_RANK_GRACE_S] if launcher_env else [])
