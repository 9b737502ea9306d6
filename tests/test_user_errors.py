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
