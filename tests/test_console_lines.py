"""Console lines stay whole when ranks share one stdout: every line a training run prints goes out in one
write call ending in its newline, and the tests' log parsers read a log line wherever it stands."""
import json
import os
import subprocess
import sys

import pytest

from megatron.core.console import write_line
from pretrain_utils import REPO, _pretrain_argv, losses_from_log, log_records, run_ranks


class _WriteCalls:
    """A text stream that keeps each ``write`` call's text."""

    def __init__(self):
        self.calls = []

    def write(self, text):
        self.calls.append(text)
        return len(text)

    def flush(self):
        pass


def test_write_line_is_one_write_call_with_the_newline():
    stream = _WriteCalls()
    write_line("iteration 1 | lm loss: 1 |", file=stream)
    write_line("header:\n  row", file=stream)  # a block of lines goes out together
    assert stream.calls == ["iteration 1 | lm loss: 1 |\n", "header:\n  row\n"]


def test_write_line_writes_to_the_stdout_of_the_moment(capsys):
    write_line("to stdout")
    write_line("to stderr", file=sys.stderr)
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("to stdout\n", "to stderr\n")


def _recorded_writes(tmp_path, rank):
    path = tmp_path / f"writes_rank{rank}.jsonl"
    return [tuple(json.loads(line)) for line in path.read_text().splitlines()] if path.exists() else []


def _partial_writes(writes):
    """The write calls that are not whole lines (text not ending in a newline), with their stream."""
    return [(name, text) for name, text in writes if text and not text.endswith("\n")]


@pytest.mark.timeout(300)
def test_every_console_write_of_a_two_rank_run_is_whole_lines(shared_data, shakespeare_prefix, tmp_path):
    """PP=2 on 2 ranks with --logging-level DEBUG: the arguments block, model sizes, the iteration and
    evaluation lines, the memory report, the timers and the logging records on stderr are each written
    in calls that end in a newline, on both ranks (``print`` wrote text and newline in two calls)."""
    argv = _pretrain_argv(["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", "--train-iters", "3",
                           "--eval-interval", "2", "--logging-level", "DEBUG", "--save", str(tmp_path / "ckpt"),
                           "--save-interval", "3"], shared_data, shakespeare_prefix, tmp_path)
    result = run_ranks(2, [REPO / "tests" / "record_writes.py", tmp_path, *argv], timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    writes = {rank: _recorded_writes(tmp_path, rank) for rank in (0, 1)}
    for rank in (0, 1):
        assert _partial_writes(writes[rank]) == [], f"rank {rank} wrote part of a line in a call"
    stdout_of = {rank: "".join(text for name, text in writes[rank] if name == "stdout") for rank in (0, 1)}
    # What the run printed is there: the arguments (rank 0), the log lines (last rank), logging records.
    assert "------------------------ arguments ------------------------" in stdout_of[0]
    assert sorted(losses_from_log(stdout_of[1])) == [1, 2, 3]
    assert any(name == "stderr" and "setting number of microbatches" in text
               for rank in (0, 1) for name, text in writes[rank])


@pytest.mark.timeout(120)
def test_a_rank_prefixed_user_error_is_one_write(shared_data, tmp_path):
    """A user error on 2 ranks (a data prefix that does not exist) is printed as one ``[rank N] error:``
    line per rank, each in one write call."""
    argv = _pretrain_argv(["--micro-batch-size", "2", "--train-iters", "4"], shared_data, str(tmp_path / "missing_prefix"), tmp_path)
    result = run_ranks(2, [REPO / "tests" / "record_writes.py", tmp_path, *argv], timeout=100)
    assert result.returncode != 0
    for rank in (0, 1):
        writes = _recorded_writes(tmp_path, rank)
        assert _partial_writes(writes) == []
    errors = [text for rank in (0, 1) for name, text in _recorded_writes(tmp_path, rank)
              if name == "stderr" and "error: " in text]
    assert errors and all(text.count("\n") == 1 and "error: " in text for text in errors), errors


@pytest.mark.timeout(120)
def test_ranks_sharing_one_pipe_never_merge_lines():
    """Two processes that write 2,000 log-sized lines each with write_line into one unbuffered pipe
    (as torchrun's ranks share the launcher's stdout): every line read back is one whole line."""
    code = ("import sys; from megatron.core.console import write_line\n"
            "for i in range(2000): write_line(f'rank {sys.argv[1]} line {i} ' + 'x' * 250 + ' |')\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    read_end, write_end = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", code, str(rank)], stdout=write_end, env=env, cwd=REPO)
             for rank in (0, 1)]
    os.close(write_end)
    with os.fdopen(read_end, encoding="utf-8") as pipe:
        lines = pipe.read().split("\n")
    assert [proc.wait(timeout=100) for proc in procs] == [0, 0]
    assert lines.pop() == ""
    expected = {f"rank {rank} line {i} " + "x" * 250 + " |" for rank in (0, 1) for i in range(2000)}
    assert len(lines) == len(expected) and set(lines) == expected


def test_log_parsers_read_a_log_line_that_shares_its_line():
    """A log line with another rank's text before it, or two lines and then both newlines (what two
    processes writing text and newline separately produce), is still read; a malformed one still fails."""
    line = (" [2026-01-01 00:00:00.000000] iteration        {it}/       3 | consumed samples:            {s} | "
            "elapsed time per iteration (ms): 12.5 | learning rate: 1.000000E-03 | global batch size:     4 | "
            "lm loss: 1.08{it}000E+01 | loss scale: 1.0 | grad norm: 1.500 | number of skipped iterations:   0 | "
            "number of nan iterations:   0 |")
    text = ("> building GPT2BPETokenizer tokenizer ..." + line.format(it=1, s=4) + "\n"
            + line.format(it=2, s=8) + " > number of parameters on (tensor, pipeline) model parallel rank (0, 0): 9\n\n"
            + line.format(it=3, s=12) + "\n")
    assert losses_from_log(text) == {1: "1.081000E+01", 2: "1.082000E+01", 3: "1.083000E+01"}
    assert {it: record["loss"] for it, record in log_records(text).items()} == {1: 10.81, 2: 10.82, 3: 10.83}
    with pytest.raises(AssertionError, match="not in Megatron's format"):
        losses_from_log(line.format(it=1, s=4).replace("lm loss", "lm-loss"))
