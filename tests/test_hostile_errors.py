"""Faults and hostile inputs end a run with one ``error:`` line naming the file or flag, never a traceback (issue 28
item 5): a save that hits a file-size limit (the stand-in for a full disk; the previous checkpoint and tracker
stay byte for byte, and a later resume from them works), ``--save`` under a regular file, a data file missing
from a torch_dist checkpoint, saved ``args`` that are not a Namespace, a tracker that is a FIFO or a link to a
device, saved args describing a model no host can hold, and a malformed ``--split``.

Each run must end within 30 s: the loaders must neither hang (a FIFO tracker) nor start building a model of
10^9 layers. The checkpoints are the small mock-data ones of test_checkpoint_security.py (no ../shared needed).
"""
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from dist_utils import free_port, rank_env
from pretrain_utils import REPO
from test_checkpoint_security import (ITERATION, MODEL, TRAIN, _assert_one_error_line, _copy, _iteration_dir,
                                      _loader_command, _run_ranks_without_launcher, _ship_matching_manifest,
                                      checkpoints)  # noqa: F401

pytestmark = pytest.mark.timeout(900)

# The most a failing run may take: it must stop at once, not hang or build a huge model.
ENDS_WITHIN_S = 30
LOADERS = ("pretrain_gpt", "convert", "export_hf", "run_text_generation")


def _timed(run, argv):
    """``run(argv)`` -> ``(status, output)``, failing the test if it took ``ENDS_WITHIN_S`` or more."""
    start = time.monotonic()
    status, out = run(argv)
    elapsed = time.monotonic() - start
    assert elapsed < ENDS_WITHIN_S, f"took {elapsed:.1f} s: {out[-3000:]}"
    return status, out


def _loader(loader, ckpt, tmp_path, verify=True):
    if loader == "export_hf":
        pytest.importorskip("transformers", reason="export_hf needs the [hf] extra (transformers, safetensors)")
    return _loader_command(loader, ckpt, "torch_dist", tmp_path, verify)


def _rewrite_common(ckpt, change):
    """Apply ``change(state)`` to the iteration's common.pt (loaded weights-only) and ship a matching manifest."""
    from megatron.training.checkpointing import load_state_dict_file

    path = _iteration_dir(ckpt) / "common.pt"
    state = load_state_dict_file(str(path))
    change(state)
    torch.save(state, path)
    _ship_matching_manifest(ckpt)
    return path


# ---------------------------------------------------------------------------------------------------
# Hostile checkpoints: every loader
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "link_to_device"])
@pytest.mark.parametrize("loader", LOADERS)
def test_tracker_that_is_not_a_regular_file_is_refused_by_every_loader(checkpoints, tmp_path, loader, kind):
    """Used to be reported as "could not find" (training then started from scratch); a FIFO must not block."""
    ckpt = _copy(checkpoints, "torch_dist", tmp_path)
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    tracker.unlink()
    if kind == "fifo":
        os.mkfifo(tracker)
    else:
        tracker.symlink_to("/dev/zero")
    status, out = _timed(*_loader(loader, ckpt, tmp_path))
    line = _assert_one_error_line(status, out, tracker)
    assert ("a FIFO" if kind == "fifo" else "a character device") in line, line
    assert "not a regular file" in line, line
    assert not (tmp_path / "converted").exists() and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("loader", LOADERS)
def test_missing_data_file_is_named_by_every_loader(checkpoints, tmp_path, loader):
    """A checkpoint without a manifest (written by Megatron-LM, say) whose .distcp file is gone: the file is
    named, not ``iter_0000002/?``."""
    ckpt = _copy(checkpoints, "torch_dist", tmp_path)
    data_file = _iteration_dir(ckpt) / "__0_0.distcp"
    data_file.unlink()
    (_iteration_dir(ckpt) / "integrity_manifest.json").unlink()
    status, out = _timed(*_loader(loader, ckpt, tmp_path))
    line = _assert_one_error_line(status, out, data_file)
    assert "does not exist" in line and "/?" not in line, line


@pytest.mark.parametrize("value,found", [(5, "an int"), ("not args", "a str")])
@pytest.mark.parametrize("loader", LOADERS)
def test_saved_args_that_are_not_a_namespace_are_named_by_every_loader(checkpoints, tmp_path, loader, value, found):
    ckpt = _copy(checkpoints, "torch_dist", tmp_path)

    def change(state):
        state["args"] = value

    common = _rewrite_common(ckpt, change)
    status, out = _timed(*_loader(loader, ckpt, tmp_path))
    line = _assert_one_error_line(status, out, common)
    assert f"its 'args' entry is {found}, not the Namespace" in line, line


@pytest.mark.parametrize("num_layers", [0, -3, "2", True])
@pytest.mark.parametrize("loader", ["convert", "run_text_generation"])
def test_saved_model_shape_that_is_not_a_positive_int_is_named(checkpoints, tmp_path, loader, num_layers):
    """The readers that take the model's shape from the saved args (convert/export and generation's
    --use-checkpoint-args) refuse a layer count that is not a positive integer."""
    ckpt = _copy(checkpoints, "torch_dist", tmp_path)

    def change(state):
        state["args"].num_layers = num_layers

    common = _rewrite_common(ckpt, change)
    status, out = _timed(*_loader(loader, ckpt, tmp_path))
    line = _assert_one_error_line(status, out, common)
    assert f"num_layers {num_layers!r}, not a positive integer" in line, line


@pytest.mark.parametrize("change,count", [
    ({"num_layers": 10 ** 9}, None),
    ({"hidden_size": 2 ** 20, "ffn_hidden_size": 2 ** 22, "kv_channels": 2 ** 18}, None),
])
def test_generation_refuses_checkpoint_args_of_a_model_the_host_cannot_hold(checkpoints, tmp_path, change, count):
    """--use-checkpoint-args used to build a 10^9-layer model from the saved args without a word; the
    parameter count is now checked against this host's memory before anything is built."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.theoretical_memory_usage import num_parameters_in_model

    ckpt = _copy(checkpoints, "torch_dist", tmp_path)

    def apply(state):
        for name, value in change.items():
            setattr(state["args"], name, value)

    common = _rewrite_common(ckpt, apply)
    status, out = _timed(*_loader("run_text_generation", ckpt, tmp_path))
    line = _assert_one_error_line(status, out, common)
    assert "refusing to build it" in line and "of available memory" in line, line
    # The count printed is the model's (the same formula as the memory report), from the saved shape.
    argv = [*MODEL, "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            *[f"--{name.replace('_', '-')}={value}" for name, value in change.items()]]
    saved = validate_args(parse_args(args=argv))
    saved.padded_vocab_size = 128  # NullTokenizer's 100 rounded up to --make-vocab-size-divisible-by
    assert f"a model of {num_parameters_in_model(saved):,} parameters" in line, line


def test_model_memory_refusal_compares_parameters_with_host_and_gpu_memory():
    """The one decision for shapes read from a checkpoint: per-rank parameter bytes x the ranks of this host
    against its memory, or one rank's against its GPU; None when it fits."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.theoretical_memory_usage import model_memory_refusal, num_parameters_in_model

    args = validate_args(parse_args(args=[*MODEL, "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3"]))
    args.padded_vocab_size = 128
    n = num_parameters_in_model(args)
    assert model_memory_refusal(args, "X", host_memory=4 * n) is None  # fp32: exactly fits
    assert "X describes a model of" in model_memory_refusal(args, "X", host_memory=4 * n - 1)
    assert "for the 2 rank(s)" in model_memory_refusal(args, "X", local_ranks=2, host_memory=6 * n)
    assert model_memory_refusal(args, "X", device_memory=4 * n, host_memory=1) is None  # on a GPU the GPU counts
    assert "of this GPU" in model_memory_refusal(args, "X", device_memory=4 * n - 1)
    args.bf16 = True
    assert model_memory_refusal(args, "X", host_memory=2 * n) is None


# ---------------------------------------------------------------------------------------------------
# A save that hits a file-size limit (the stand-in for a full disk)
# ---------------------------------------------------------------------------------------------------

# A model whose largest checkpoint file exceeds the limit below while the small files (common.pt, RNG
# states) and the ranks' logs stay under it.
_SAVE_MODEL = [*MODEL, "--hidden-size", "64"]
_LIMIT_KIB = 256
_SAVE_FORMATS = {"torch_dist": ["--ckpt-format", "torch_dist"],
                 "torch_dist_async": ["--ckpt-format", "torch_dist", "--async-save"],
                 "torch": ["--ckpt-format", "torch"]}


def _pretrain_ranks(nproc, flags, file_size_limit_kib=None, timeout=120):
    """pretrain_gpt.py on ``nproc`` independent gloo ranks (torchrun's environment, no launcher), each under
    ``ulimit -f`` when a limit is given (a fresh bash then exec: the fork server cannot take a limit).
    Returns ``[(exit status, stdout + stderr)]`` by rank."""
    argv = [sys.executable, "pretrain_gpt.py", *_SAVE_MODEL, *TRAIN, *map(str, flags)]
    if file_size_limit_kib is not None:
        # CPython ignores SIGXFSZ, so a write past the limit fails with EFBIG instead of killing the rank.
        argv = ["bash", "-c", f'ulimit -f {file_size_limit_kib} && exec "$@"', "bash", *argv]
    port = free_port()
    procs = []
    with tempfile.TemporaryDirectory(prefix="ranks_") as logs:
        try:
            for rank in range(nproc):
                env = rank_env(dict(os.environ, OMP_NUM_THREADS="1"), rank, nproc, port)
                # A file, not a pipe: no rank blocks on a full pipe (the log stays far below the limit).
                with open(Path(logs) / f"rank{rank}", "w") as log:
                    procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
            statuses = [proc.wait(timeout=timeout) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        return [(status, (Path(logs) / f"rank{rank}").read_text(errors="replace"))
                for rank, status in enumerate(statuses)]


def _tree_digests(directory):
    """{relative path: sha256} of every entry under ``directory`` (hidden ones included; directories as 'dir')."""
    digests = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            digests[os.path.relpath(os.path.join(root, name), directory)] = "dir"
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                digests[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return digests


@pytest.mark.parametrize("ckpt_format", sorted(_SAVE_FORMATS))
def test_save_past_a_file_size_limit_is_one_line_per_rank_and_keeps_the_previous_checkpoint(tmp_path, ckpt_format):
    """Two ranks train 2 iterations and save; a resumed run under ``ulimit -f`` fails writing iteration 4 (with
    --async-save: in the background, reported at the publish). Every rank exits non-zero, within 30 s of when the
    clean run of the same length ended, with one error line and no traceback (rank 0 names the file and the cause, or the other rank's failure); the checkpoint directory is
    byte for byte what it was (tracker and iteration 2, no leftovers); resuming without the limit loads 2 and
    saves 4."""
    ckpt = tmp_path / "ckpt"
    flags = ["--train-iters", "4", "--save", ckpt, "--load", ckpt, "--save-interval", "2", "--global-batch-size", "4",
             *_SAVE_FORMATS[ckpt_format]]
    start = time.monotonic()
    first = _pretrain_ranks(2, [*flags, "--exit-interval", "2"])
    clean_run_s = time.monotonic() - start
    assert [status for status, _ in first] == [0, 0], first[0][1][-3000:]
    largest = max(path.stat().st_size for path in ckpt.rglob("*") if path.is_file())
    assert largest > _LIMIT_KIB * 1024, f"the checkpoint's largest file ({largest} bytes) is under the limit"
    before = _tree_digests(ckpt)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    start = time.monotonic()
    ranks = _pretrain_ranks(2, flags, file_size_limit_kib=_LIMIT_KIB)
    # The same start-up and 2 iterations as the clean run, then the failed save: it must end within
    # ENDS_WITHIN_S of that (start-up alone can take longer than 30 s on a loaded machine).
    failing_run_s = time.monotonic() - start
    assert failing_run_s < clean_run_s + ENDS_WITHIN_S, (failing_run_s, clean_run_s)
    for rank, (status, out) in enumerate(ranks):
        assert status == 1, f"rank {rank} exit {status}: {out[-3000:]}"
        assert "Traceback" not in out and "terminate called" not in out, f"rank {rank}: {out[-4000:]}"
        lines = [line for line in out.splitlines() if "error: " in line]
        assert len(lines) == 1 and lines[0].startswith(f"[rank {rank}] error: "), f"rank {rank}: {out[-3000:]}"
        assert "saving checkpoint at iteration 4" in lines[0], lines[0]
        assert "the previous checkpoint and tracker were left unchanged" in lines[0], lines[0]
    rank0 = [line for line in ranks[0][1].splitlines() if "error: " in line][0]
    assert f"could not write {ckpt}/.iter_0000004.tmp-" in rank0, rank0
    assert "File too large (disk full or file-size limit" in rank0, rank0
    assert _tree_digests(ckpt) == before  # tracker, iteration 2 and its manifest untouched; nothing left over

    resumed = _pretrain_ranks(2, flags)
    assert [status for status, _ in resumed] == [0, 0], resumed[0][1][-3000:]
    assert "successfully loaded checkpoint from" in resumed[0][1] and "at iteration 2" in resumed[0][1]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]


def test_injected_write_error_names_the_file_on_the_failing_rank():
    """The message of a failed write: the file, the cause and what it most likely means."""
    import errno

    from megatron.training.checkpointing import write_failure

    for number, hint in ((errno.EFBIG, "disk full or file-size limit"), (errno.ENOSPC, "disk full"),
                         (errno.EACCES, None)):
        error = write_failure(OSError(number, os.strerror(number)), "/ckpt/.iter_0000004.tmp-1/__0_0.distcp")
        assert error.errno == number
        assert str(error).startswith(f"could not write /ckpt/.iter_0000004.tmp-1/__0_0.distcp: {os.strerror(number)}")
        assert (hint is None) == ("(" not in str(error)) and (hint is None or hint in str(error)), str(error)


# ---------------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------------

def _run_one(argv):
    return _run_ranks_without_launcher(1, argv)


def test_save_under_a_regular_file_is_one_line_before_training(tmp_path):
    """Used to train, then fail at the first save with a good sentence inside a traceback."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    status, out = _timed(_run_one, ["pretrain_gpt.py", *MODEL, *TRAIN, "--train-iters", "2", "--save", blocker / "ckpt",
                                    "--save-interval", "1"])
    line = _assert_one_error_line(status, out, f"--save {blocker / 'ckpt'}")
    assert f"{blocker} is a file, not a directory" in line, line
    assert "iteration        1/" not in out  # refused before training


@pytest.mark.parametrize("split", ["abc", "98,2,x", "98,,2", "1e3", ""])
def test_malformed_split_is_one_line_from_rank_0(tmp_path, split):
    """``--split abc`` used to print a traceback on every rank saying the weights were all zero, and
    ``--split 98,2,x`` was read as 98,2,0 silently."""
    from dist_utils import fork_ranks, use_torchrun

    argv = ["pretrain_gpt.py", *MODEL, *TRAIN, "--train-iters", "2", "--split", split]
    port = free_port()
    envs = [rank_env(dict(os.environ, OMP_NUM_THREADS="1"), rank, 2, port) for rank in range(2)]
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    start = time.monotonic()
    if use_torchrun():
        procs = []
        for rank in range(2):
            with open(logs[rank], "w") as log:
                procs.append(subprocess.Popen([sys.executable, *argv], cwd=REPO, env=envs[rank], stdout=log,
                                              stderr=subprocess.STDOUT))
        statuses = [proc.wait(timeout=120) for proc in procs]
    else:
        statuses = fork_ranks(2, argv, envs, REPO, logs, logs, 120, stop_others_on_failure=False)
    assert time.monotonic() - start < ENDS_WITHIN_S
    outs = [log.read_text() for log in logs]
    assert statuses == [2, 2], outs[0][-2000:]
    assert all("Traceback" not in out for out in outs), outs
    rank0 = [line for line in outs[0].splitlines() if "error: " in line]
    assert rank0 == [f"error: --split {split!r}: expected one to three non-negative numbers (train, valid, test "
                     "weights) separated by ',' or '/', e.g. '969,30,1', '98,2' or '1'"], outs[0][-2000:]
    assert [line for line in outs[1].splitlines() if "error: " in line] == [], outs[1][-2000:]


def test_split_accepts_megatron_forms_and_refuses_anything_else():
    from megatron.core.datasets.utils import parse_and_normalize_split
    from megatron.training.arguments import parse_args, validate_args

    for split, expected in (("969,30,1", [0.969, 0.03, 0.001]), ("969, 30, 1", [0.969, 0.03, 0.001]),
                            ("98,2", [0.98, 0.02, 0.0]), ("1", [1.0, 0.0, 0.0]), ("98/2/0", [0.98, 0.02, 0.0]),
                            ("49.5, 0.5", [0.99, 0.01, 0.0]), ("98 2", [0.98, 0.02, 0.0])):
        assert parse_and_normalize_split(split) == pytest.approx(expected), split
    base = [*MODEL, "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3"]
    assert validate_args(parse_args(args=[*base, "--split", "98,2"])).split == "98,2"  # kept as given
    for split in ("abc", "98,2,x", "98,2,", ",98", "98;2", "98.2.1", "0x10", "1,2,3,4", "0,0"):
        with pytest.raises(ValueError, match=f"^--split {split!r}: "):
            validate_args(parse_args(args=[*base, "--split", split]))
