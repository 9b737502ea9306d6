"""Run pretrain_gpt.py on CPU gloo ranks (forked from the fork server, or under torchrun) for end-to-end
tests, and read back its log and TensorBoard."""
import json
import os
import re
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from dist_utils import fork_ranks, free_port, rank_env, use_torchrun

REPO = Path(__file__).resolve().parents[1]
# The patterns are not anchored to a line: a log line found anywhere in the output counts, so a line
# that still shares its text with another process's output (a launcher's, a library's) is read too.
LOG_LINE = re.compile(
    r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration\s+(\d+)/\s+(\d+) \| consumed samples:\s+(\d+) \| "
    r"elapsed time per iteration \(ms\): [0-9.]+ \| learning rate: [0-9.]+E[+-]\d+ \| global batch size:\s+(\d+) \| "
    r"lm loss: ([0-9.]+E[+-]\d+) \| loss scale: 1\.0 \| grad norm: ([0-9.]+) \| "
    r"number of skipped iterations:\s+0 \| number of nan iterations:\s+0 \|"
)
# Any log line of a run without --log-throughput/--log-num-zeros-in-grad/--log-params-norm: a mixed-precision
# run may have a loss scale other than 1.0 and skipped iterations, and an interval whose steps were all
# skipped prints neither a loss nor a grad norm.
ANY_LOG_LINE = re.compile(
    r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration\s+(?P<iteration>\d+)/\s+\d+ \| "
    r"consumed samples:\s+\d+ \| elapsed time per iteration \(ms\): [0-9.]+ \| "
    r"learning rate: [0-9.]+E[+-]\d+ \| global batch size:\s+\d+ \| "
    r"(?:lm loss: (?P<loss>[0-9.]+E[+-]\d+) \| )?loss scale: (?P<loss_scale>[0-9.]+) \| "
    r"(?:grad norm: (?P<grad_norm>[0-9.]+) \| )?number of skipped iterations:\s+(?P<skipped>\d+) \| "
    r"number of nan iterations:\s+(?P<nan>\d+) \|"
)


def preprocess_shakespeare(shared_data: Path, out_dir: Path, sentencepiece: bool = False) -> str:
    """Tokenise ../shared/data/tinyshakespeare.jsonl with GPT-2 BPE (or, with ``sentencepiece``, the
    8k SentencePiece model, see :func:`sentencepiece_flags`); returns the dataset prefix."""
    out = out_dir / ("shakes_sp8k" if sentencepiece else "shakes")
    run_python(
        ["tools/preprocess_data.py", "--input", str(shared_data / "tinyshakespeare.jsonl"),
         "--output-prefix", str(out), *(sentencepiece_flags(shared_data) if sentencepiece else [
             "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(shared_data / "gpt2-vocab.json"),
             "--merge-file", str(shared_data / "gpt2-merges.txt")]),
         "--append-eod", "--workers", "1", "--log-interval", "100000"])
    return str(out) + "_text_document"


def run_python(argv, timeout=300) -> subprocess.CompletedProcess:
    """``python argv...`` in the repository, output captured; raises ``subprocess.CalledProcessError`` when
    it fails. One process forked from the fork server (a fresh interpreter with PRETRAIN_TESTS_TORCHRUN=1)."""
    argv = [str(a) for a in argv]
    if use_torchrun():
        return subprocess.run([sys.executable, *argv], cwd=REPO, check=True, capture_output=True, text=True,
                              timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="python_") as logs:
        out, err = Path(logs) / "stdout", Path(logs) / "stderr"
        status, = fork_ranks(1, argv, [dict(os.environ)], REPO, [out], [err], timeout)
        result = subprocess.CompletedProcess(argv, status, out.read_text(errors="replace"),
                                             err.read_text(errors="replace"))
    result.check_returncode()
    return result


def sentencepiece_flags(shared_data: Path) -> list:
    """Tokenizer flags of the 8k SentencePiece model: a vocabulary 6x smaller than GPT-2's, for runs
    whose output layer would be slow on CPU (fp16 matmuls have no fast CPU kernel)."""
    return ["--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", str(shared_data / "shakespeare-sp8k.model")]


def run_pretrain(nproc, flags, shared_data, data_prefix, tmp_path, expect_failure=False, stderr_too=False) -> str:
    """Train a 2-layer, hidden-32 GPT on ``nproc`` gloo ranks; later ``flags`` override the defaults.

    Returns stdout (stdout + stderr when ``expect_failure`` or ``stderr_too``). Fails the test if the
    exit status is not what was expected. The ranks are started by :func:`run_ranks`.
    """
    result = run_ranks(nproc, _pretrain_argv(flags, shared_data, data_prefix, tmp_path), timeout=300)
    if expect_failure:
        assert result.returncode != 0, result.stdout[-3000:]
        return result.stdout + result.stderr
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr if stderr_too else result.stdout


def run_ranks(nproc, argv, env=None, timeout=300) -> subprocess.CompletedProcess:
    """``python argv...`` on ``nproc`` gloo ranks with torchrun's environment, in the repository, with
    OMP_NUM_THREADS=1 over ``env`` (default: this process's); stdout and stderr captured.

    The ranks are forked from the preloaded fork server (dist_utils.fork_ranks) and, as under torchrun,
    the first to fail gets the others stopped and the launch fails (status 1); the ranks' outputs are
    joined in rank order. PRETRAIN_TESTS_TORCHRUN=1 runs ``torchrun --standalone`` instead. Raises
    ``subprocess.TimeoutExpired`` after ``timeout`` seconds.
    """
    argv = [str(a) for a in argv]
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    if use_torchrun():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *argv]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="ranks_") as logs:
        out = [Path(logs) / f"rank{r}.out" for r in range(nproc)]
        err = [Path(logs) / f"rank{r}.err" for r in range(nproc)]
        port = free_port()
        run_id = str(uuid.uuid4())  # torchrun --standalone: a random rendezvous id
        envs = [rank_env(env, r, nproc, port, GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(r),
                         ROLE_WORLD_SIZE=str(nproc), ROLE_NAME="default", TORCHELASTIC_RESTART_COUNT="0",
                         TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID=run_id) for r in range(nproc)]
        statuses = fork_ranks(nproc, argv, envs, REPO, out, err, timeout)
        stdout = "".join(p.read_text(errors="replace") for p in out)
        stderr = "".join(p.read_text(errors="replace") for p in err)
    failed = [f"rank {r} exited with status {s}\n" for r, s in enumerate(statuses) if s != 0]
    return subprocess.CompletedProcess(argv, 1 if failed else 0, stdout, stderr + "".join(failed))


def run_ranks_without_launcher(nproc, flags, shared_data, data_prefix, tmp_path, timeout=300) -> list:
    """Start the ``nproc`` ranks of ``pretrain_gpt.py`` as independent processes (torchrun's environment
    variables, no torchrun) and wait for each: ``[(exit status, stdout + stderr)]`` indexed by rank.

    For start-up failures on every rank: under torchrun the first rank to fail gets the others killed,
    so which ranks print their message depends on timing; here each rank runs to its own end. The ranks
    are forked from the fork server (fresh interpreters with PRETRAIN_TESTS_TORCHRUN=1).
    """
    argv = _pretrain_argv(flags, shared_data, data_prefix, tmp_path)
    port = free_port()
    logs = [tmp_path / f"rank{rank}.log" for rank in range(nproc)]
    envs = [rank_env(dict(os.environ, OMP_NUM_THREADS="1"), rank, nproc, port) for rank in range(nproc)]
    if not use_torchrun():
        statuses = fork_ranks(nproc, argv, envs, REPO, logs, logs, timeout, stop_others_on_failure=False)
        return [(status, log.read_text()) for status, log in zip(statuses, logs)]
    procs = []
    try:
        for rank in range(nproc):
            with open(logs[rank], "w") as log:  # a file, not a pipe: no rank blocks on a full pipe
                procs.append(subprocess.Popen([sys.executable, *argv], cwd=REPO, env=envs[rank], stdout=log,
                                              stderr=subprocess.STDOUT))
        statuses = [proc.wait(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [(status, log.read_text()) for status, log in zip(statuses, logs)]


def _pretrain_argv(flags, shared_data, data_prefix, tmp_path) -> list:
    """``pretrain_gpt.py`` and the flags of the small test model; later ``flags`` override the defaults."""
    cmd = [
        "pretrain_gpt.py",
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--seed", "1234", "--log-interval", "1",
        "--data-path", data_prefix, "--split", "98,2,0", "--num-workers", "0", "--eval-iters", "1",
        "--eval-interval", "4", "--data-cache-path", str(tmp_path / "cache"),
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(shared_data / "gpt2-vocab.json"),
        "--merge-file", str(shared_data / "gpt2-merges.txt"), "--distributed-backend", "gloo",
        *flags,
    ]
    if "--train-samples" in flags:  # sample-based runs take --lr-warmup-samples instead
        at = cmd.index("--lr-warmup-iters")
        del cmd[at:at + 2]
    return cmd


def log_line_matches(stdout: str, pattern=LOG_LINE) -> list:
    """Every match of ``pattern`` (:data:`LOG_LINE` or :data:`ANY_LOG_LINE`) in ``stdout``, wherever it
    stands in a line; fails the test naming the text when an ``elapsed time per iteration`` in the
    output is not inside a match (a log line not in Megatron's format)."""
    matches = list(pattern.finditer(stdout))
    marker = "elapsed time per iteration"
    at = stdout.find(marker)
    while at != -1:
        if not any(m.start() <= at < m.end() for m in matches):
            line_start = stdout.rfind("\n", 0, at) + 1
            line_end = stdout.find("\n", at)
            line = stdout[line_start:None if line_end == -1 else line_end]
            raise AssertionError(f"log line not in Megatron's format: {line!r}")
        at = stdout.find(marker, at + len(marker))
    return matches


def losses_from_log(stdout: str) -> dict:
    """{iteration: printed lm loss string} from the Megatron training log lines (format checked)."""
    return {int(match.group(1)): match.group(5) for match in log_line_matches(stdout, LOG_LINE)}


def log_records(stdout: str) -> dict:
    """{iteration: {'loss': float or None, 'loss_scale': float, 'grad_norm': float or None, 'skipped': int,
    'nan': int}} from every training log line (format checked with :data:`ANY_LOG_LINE`)."""
    records = {}
    for match in log_line_matches(stdout, ANY_LOG_LINE):
        loss, grad_norm = match.group("loss"), match.group("grad_norm")
        records[int(match.group("iteration"))] = {
            "loss": None if loss is None else float(loss), "loss_scale": float(match.group("loss_scale")),
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "skipped": int(match.group("skipped")), "nan": int(match.group("nan")),
        }
    return records


def tensorboard_scalars(log_dir, tag: str) -> dict:
    """{step: value} of one TensorBoard scalar tag (float32 as written, unlike the rounded log line)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


def load_checkpoint_tool(name):
    """Import ``tools/checkpoint/<name>.py`` as a module (the tools are scripts, not a package; their
    directory goes on sys.path so that they import each other as they do when run)."""
    import importlib.util

    tools = REPO / "tools" / "checkpoint"
    if str(tools) not in sys.path:
        sys.path.insert(0, str(tools))
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", tools / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def console_objects(stdout: str) -> list:
    """Every JSON object the console exporters printed (spans, metric snapshots, log records).

    An exporter thread's line can land between a ``print``'s text and its newline on the training
    thread, so an object is decoded wherever it starts in a line, not only at the line's start.
    """
    decoder = json.JSONDecoder()
    objs = []
    for line in stdout.splitlines():
        start = line.find('{"')
        while start != -1:
            try:
                obj, end = decoder.raw_decode(line, start)
            except ValueError:
                start = line.find('{"', start + 1)
                continue
            objs.append(obj)
            start = line.find('{"', end)
    return objs


def one_process_references(train, tmp_path_factory, name):
    """``flags -> train(1, list(flags), fresh directory, "ref")``, each distinct flag list run once: the body of
    a module fixture of one-process reference runs (a parallel layout is compared with the run of its flags)."""
    cache = {}

    def get(flags):
        key = tuple(flags)
        if key not in cache:
            cache[key] = train(1, list(key), tmp_path_factory.mktemp(name), "ref")
        return cache[key]
    return get
