"""Fault drills for checkpoints: damaged files, crashes inside a save and between its renames, a full disk,
SIGKILL and SIGTERM of a training run, non-persistent checkpoints (checkpoint_integrity.py).

The in-process drills save the small model of test_checkpointing.py; the end-to-end drills run
tests/faulty_pretrain.py (pretrain_gpt.py with a fault-injecting checkpoint storage) and wait for the marker
file its hooks (MEGATRON_TEST_*) create, never for time.
"""
import errno
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron.training import checkpoint_integrity
from megatron.training.checkpoint_integrity import CheckpointIntegrityError
from megatron.training.checkpointing import durable, get_checkpoint_name, load_checkpoint, save_checkpoint

import faulty_pretrain
from dist_utils import free_port
from pretrain_utils import REPO, _pretrain_argv, losses_from_log
from test_checkpointing import _assert_same_params, _fresh, _make_args, _seeded_tracker, _trained  # noqa: F401

pytestmark = pytest.mark.timeout(300)

# Formats the end-to-end drills run with: the flags of each.
FORMATS = {"torch": ["--ckpt-format", "torch"], "torch_dist": ["--ckpt-format", "torch_dist"],
           "torch_dist_async": ["--ckpt-format", "torch_dist", "--async-save"]}
HOOK_VARIABLES = ("MEGATRON_TEST_SLEEP_IN_SAVE", "MEGATRON_TEST_ENOSPC_IN_SAVE", "MEGATRON_TEST_CRASH_AT",
                  "MEGATRON_TEST_HOOK_ITERATION", "MEGATRON_TEST_HOOK_RANK", "MEGATRON_TEST_HOOK_MARKER",
                  "MEGATRON_TEST_NO_RENAME_EXCHANGE", "MEGATRON_TEST_HOOK_RELEASE")


@pytest.fixture(autouse=True)
def _no_hooks_from_outside(monkeypatch):
    for name in HOOK_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _tracker(ckpt):
    return (Path(ckpt) / "latest_checkpointed_iteration.txt").read_text().strip()


def _saved(tmp_path, iterations, **overrides):
    """Save the trained model at each of ``iterations`` (FLOPs = 10 x iteration); returns (args, model);
    ``_saved.optimizer`` is the optimizer saved last."""
    args = _make_args(tmp_path, **overrides)
    model, optimizer, scheduler = _trained()
    for iteration in iterations:
        save_checkpoint(iteration, model, optimizer, scheduler, 10 * iteration)
    _saved.optimizer = optimizer
    return args, model


def _flip_bit_in_tensor(path, tensor):
    """Flip one bit of the stored bytes of ``tensor`` in the checkpoint file ``path`` (torch.save stores
    storages uncompressed, so its bytes appear as they are)."""
    data = tensor.detach().contiguous().numpy().tobytes()
    with open(path, "rb") as f:
        whole = f.read()
    at = whole.find(data)
    assert at >= 0 and whole.find(data, at + 1) < 0, "the tensor's bytes are not found once in the file"
    at += len(data) // 2 + 3  # the most significant byte of a float32 in the middle (little-endian)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes([whole[at] ^ 0x40]))


# ---------------------------------------------------------------------------------------------------
# Manifest and damaged files
# ---------------------------------------------------------------------------------------------------

def test_manifest_lists_every_file_with_size_and_crc(tmp_path):
    args, _ = _saved(tmp_path, [3])
    directory = Path(args.save) / "iter_0000003"
    manifest = json.loads((directory / "integrity_manifest.json").read_text())
    assert manifest["iteration"] == 3 and manifest["algorithm"] == "crc32"
    name = "mp_rank_00/model_optim_rng.pt"
    assert list(manifest["files"]) == [name]
    size, crc = checkpoint_integrity.file_digest(directory / name)
    assert manifest["files"][name] == {"size": size, "crc32": crc} and size == (directory / name).stat().st_size


def test_manifest_takes_digests_a_writer_computed_when_the_size_matches(tmp_path):
    """An --async-save writer digests its files in the background; the manifest then does not read them again
    (a digest whose size no longer matches is recomputed)."""
    directory = tmp_path / "dir"
    (directory / "sub").mkdir(parents=True)
    (directory / "a.bin").write_bytes(b"a" * 100)
    (directory / "sub" / "b.bin").write_bytes(b"b" * 50)
    known = {"a.bin": {"size": 100, "crc32": "feedbeef"}, "sub/b.bin": {"size": 49, "crc32": "00000000"}}
    checkpoint_integrity.write_manifest(str(directory), 7, known_digests=known)
    files = json.loads((directory / "integrity_manifest.json").read_text())["files"]
    assert files["a.bin"] == {"size": 100, "crc32": "feedbeef"}  # taken as given
    assert files["sub/b.bin"] == checkpoint_integrity.digest_files(str(directory), ["sub/b.bin"])["sub/b.bin"]
    assert files["sub/b.bin"]["size"] == 50


def test_bit_flip_in_optimizer_tensor_is_refused_and_load_falls_back(tmp_path, capsys):
    """One flipped bit in an Adam moment: the file is named, the previous iteration is loaded instead."""
    args, model = _saved(tmp_path, [2, 4])
    damaged = get_checkpoint_name(args.load, 4)
    adam_moment = _saved.optimizer.state_dict()["state"][0]["exp_avg"]
    _flip_bit_in_tensor(damaged, adam_moment)
    capsys.readouterr()
    fresh = _fresh()
    assert load_checkpoint(*fresh) == (2, 20)
    _assert_same_params(model[0].module, fresh[0][0])
    out = capsys.readouterr().out
    assert f"iteration 4 ({os.path.join(args.load, 'iter_0000004')}) is incomplete or corrupt" in out, out
    assert f"{damaged} is corrupt: CRC-32" in out, out
    assert f"loading iteration 2 ({os.path.join(args.load, 'iter_0000002')})" in out, out

    args.ckpt_step = 4
    with pytest.raises(CheckpointIntegrityError, match=f"--ckpt-step 4: checkpoint .*iter_0000004 .*cannot be loaded: "
                                                       f"{damaged} is corrupt: CRC-32"):
        load_checkpoint(*_fresh())

    # --no-verify-checkpoint skips the CRC-32s: the flipped bit is loaded silently (why the check exists).
    args.ckpt_step, args.no_verify_checkpoint = None, True
    fresh_model, fresh_optimizer, fresh_scheduler = _fresh()
    assert load_checkpoint(fresh_model, fresh_optimizer, fresh_scheduler) == (4, 40)
    _assert_same_params(model[0].module, fresh_model[0])
    saved, loaded = _saved.optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    differing = [(i, key) for i in saved for key in saved[i] if not torch.equal(saved[i][key], loaded[i][key])]
    assert differing == [(0, "exp_avg")], differing


def test_truncated_file_is_refused_even_without_crc_check(tmp_path, capsys):
    args, _ = _saved(tmp_path, [2, 4])
    damaged = get_checkpoint_name(args.load, 4)
    size = os.path.getsize(damaged)
    os.truncate(damaged, size - 100)
    for verify in (True, False):
        args.no_verify_checkpoint = not verify
        capsys.readouterr()
        assert load_checkpoint(*_fresh()) == (2, 20)
        out = capsys.readouterr().out
        assert f"{damaged} is truncated or damaged: {size - 100} bytes, integrity_manifest.json says {size}" in out


def test_every_iteration_damaged_is_an_error_naming_the_newest(tmp_path):
    args, _ = _saved(tmp_path, [2, 4])
    for iteration in (2, 4):
        os.truncate(get_checkpoint_name(args.load, iteration), 10)
    with pytest.raises(CheckpointIntegrityError, match=r"no complete checkpoint to load: --load .*: the newest, "
                                                       r"iteration 4 .*iter_0000004/mp_rank_00/model_optim_rng.pt "
                                                       r"is truncated"):
        load_checkpoint(*_fresh())


def test_missing_file_and_missing_directory_fall_back(tmp_path, capsys):
    args, _ = _saved(tmp_path, [2, 4, 6])
    os.remove(get_checkpoint_name(args.load, 6))
    assert load_checkpoint(*_fresh()) == (4, 40)
    assert "iter_0000006/mp_rank_00/model_optim_rng.pt is missing (listed in integrity_manifest.json)" in \
        capsys.readouterr().out
    shutil.rmtree(os.path.join(args.load, "iter_0000006"))
    shutil.rmtree(os.path.join(args.load, "iter_0000004"))
    assert load_checkpoint(*_fresh()) == (2, 20)
    assert "iter_0000006 does not exist" in capsys.readouterr().out


def test_corrupt_manifest_is_named(tmp_path, capsys):
    args, _ = _saved(tmp_path, [2, 4])
    manifest = os.path.join(args.load, "iter_0000004", "integrity_manifest.json")
    with open(manifest, "w") as f:
        f.write('{"files": ')
    assert load_checkpoint(*_fresh()) == (2, 20)
    assert f"checkpoint manifest {manifest} is corrupt" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------
# Crashes inside a save (child processes killed by the test hooks)
# ---------------------------------------------------------------------------------------------------

def _save_in_child(tmp_path, iteration, seed, env):
    os.environ.update(env)
    faulty_pretrain.install()
    _make_args(tmp_path)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    model, optimizer, scheduler = _trained(seed=seed)
    save_checkpoint(iteration, model, optimizer, scheduler, 10 * iteration)


def _run_killed_save(tmp_path, iteration, seed, env):
    """Save in a spawned child that the hooks of ``env`` SIGKILL; asserts it died by SIGKILL."""
    child = multiprocessing.get_context("spawn").Process(target=_save_in_child,
                                                         args=(tmp_path, iteration, seed, env))
    child.start()
    child.join(120)
    if child.is_alive():
        child.kill()
    assert child.exitcode == -signal.SIGKILL, child.exitcode


@pytest.mark.parametrize("point", ["in_write", "before_publish"])
def test_crash_inside_a_save_keeps_the_previous_checkpoint(tmp_path, point):
    args, model = _saved(tmp_path, [2])
    _run_killed_save(tmp_path, 4, seed=9, env={"MEGATRON_TEST_CRASH_AT": point})
    assert _tracker(args.save) == "2" and not os.path.exists(os.path.join(args.save, "iter_0000004"))
    fresh = _fresh()
    assert load_checkpoint(*fresh) == (2, 20)
    _assert_same_params(model[0].module, fresh[0][0])
    # The next save clears the leftover temporary directory.
    _saved(tmp_path, [4])
    assert sorted(os.listdir(args.save)) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]


@pytest.mark.parametrize("exchange", [True, False], ids=["rename_exchange", "fallback"])
def test_crash_between_the_renames_of_a_resave_leaves_the_tracker_valid(tmp_path, exchange, capsys):
    """Re-saving the iteration the tracker names (a finished job run again), killed between the renames."""
    if exchange:
        probe = tmp_path / "probe"
        (probe / "a").mkdir(parents=True)
        (probe / "b").mkdir()
        if not checkpoint_integrity.exchange_paths(str(probe / "a"), str(probe / "b")):
            pytest.skip("renameat2(RENAME_EXCHANGE) is not available on this file system")
    args, first = _saved(tmp_path, [4])
    env = {"MEGATRON_TEST_CRASH_AT": "between_renames"}
    if not exchange:
        env["MEGATRON_TEST_NO_RENAME_EXCHANGE"] = "1"
    _run_killed_save(tmp_path, 4, seed=9, env=env)
    entries = sorted(os.listdir(args.save))
    assert _tracker(args.save) == "4"
    if exchange:  # the new directory is in place; the old one waits under the temporary name
        assert "iter_0000004" in entries and any(e.startswith(".iter_0000004.tmp-") for e in entries), entries
    else:  # the old directory stepped aside; the new one is still the temporary
        assert "iter_0000004" not in entries and any(e.startswith(".iter_0000004.old-") for e in entries), entries
    capsys.readouterr()
    fresh = _fresh()
    assert load_checkpoint(*fresh) == (4, 40)
    if exchange:
        second, _, _ = _trained(seed=9)
        _assert_same_params(second[0].module, fresh[0][0])
    else:
        _assert_same_params(first[0].module, fresh[0][0])
        assert "restored" in capsys.readouterr().out
    _saved(tmp_path, [6])  # the next save removes what is left
    assert sorted(os.listdir(args.save)) == ["iter_0000004", "iter_0000006", "latest_checkpointed_iteration.txt"]


def test_crash_before_the_tracker_keeps_the_previous_iteration_named(tmp_path):
    args, _ = _saved(tmp_path, [2])
    _run_killed_save(tmp_path, 4, seed=9, env={"MEGATRON_TEST_CRASH_AT": "before_tracker"})
    assert _tracker(args.save) == "2"
    assert load_checkpoint(*_fresh()) == (2, 20)


# ---------------------------------------------------------------------------------------------------
# Full disk
# ---------------------------------------------------------------------------------------------------

def test_injected_enospc_gives_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    args, model = _saved(tmp_path, [2])
    monkeypatch.setenv("MEGATRON_TEST_ENOSPC_IN_SAVE", "1")
    monkeypatch.setenv("MEGATRON_TEST_HOOK_ITERATION", "4")
    monkeypatch.setattr(durable, "_STORAGE", faulty_pretrain.FaultyStorage())
    with pytest.raises(OSError, match="No space left on device .*saving checkpoint at iteration 4 to .*iter_0000004 "
                                      "failed; the previous checkpoint and tracker were left unchanged") as info:
        _saved(tmp_path, [4])
    assert info.value.errno == errno.ENOSPC
    assert sorted(os.listdir(args.save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    fresh = _fresh()
    assert load_checkpoint(*fresh) == (2, 20)
    _assert_same_params(model[0].module, fresh[0][0])


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs at tmp_path/disk (needs root and mount permission; skipped otherwise)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the injected ENOSPC drill covers a full disk")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); the injected ENOSPC drill covers it")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_full_tmpfs_gives_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path, small_tmpfs):
    args = _make_args(tmp_path, save=str(small_tmpfs / "ckpt"), load=str(small_tmpfs / "ckpt"))
    model, optimizer, scheduler = _trained()
    save_checkpoint(2, model, optimizer, scheduler, 20)
    size = os.path.getsize(get_checkpoint_name(args.save, 2))
    stat = os.statvfs(small_tmpfs)
    filler = stat.f_bavail * stat.f_frsize - size // 2  # room for half a checkpoint
    with open(small_tmpfs / "filler", "wb") as f:
        f.write(b"\0" * filler)
    with pytest.raises(OSError, match="No space left on device.*iter_0000004.*the previous checkpoint and tracker "
                                      "were left unchanged") as info:
        save_checkpoint(4, model, optimizer, scheduler, 40)
    assert info.value.errno == errno.ENOSPC
    assert sorted(os.listdir(args.save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    fresh = _fresh()
    assert load_checkpoint(*fresh) == (2, 20)
    _assert_same_params(model[0].module, fresh[0][0])


# ---------------------------------------------------------------------------------------------------
# Non-persistent checkpoints
# ---------------------------------------------------------------------------------------------------

def test_non_persistent_checkpoints_keep_the_newest_and_load_picks_the_newer(tmp_path, capsys):
    args = _make_args(tmp_path, non_persistent_ckpt_type="global", non_persistent_global_ckpt_dir=None)
    model, optimizer, scheduler = _trained()
    save_checkpoint(4, model, optimizer, scheduler, 40)
    for iteration in (5, 6):
        save_checkpoint(iteration, model, optimizer, scheduler, 10 * iteration, non_persistent_ckpt=True)
    non_persistent = Path(args.save) / "non_persistent"
    assert sorted(os.listdir(non_persistent)) == ["iter_0000006", "latest_checkpointed_iteration.txt"]
    assert _tracker(args.save) == "4" and _tracker(non_persistent) == "6"
    capsys.readouterr()
    assert load_checkpoint(*_fresh()) == (6, 60)
    assert f"loading non-persistent checkpoint of iteration 6 from {non_persistent}" in capsys.readouterr().out

    save_checkpoint(8, model, optimizer, scheduler, 80)  # a newer persistent one wins
    assert load_checkpoint(*_fresh()) == (8, 80)
    # Without --non-persistent-ckpt-type the non-persistent directory is not looked at (as in Megatron-LM).
    args.non_persistent_ckpt_type = None
    save_checkpoint(9, model, optimizer, scheduler, 90, non_persistent_ckpt=True)
    assert load_checkpoint(*_fresh()) == (8, 80)
    # A damaged non-persistent checkpoint (the only one there) gives way to the persistent one, with a warning.
    args.non_persistent_ckpt_type = "global"
    damaged = non_persistent / "iter_0000009" / "mp_rank_00" / "model_optim_rng.pt"
    os.truncate(damaged, 100)
    capsys.readouterr()
    assert load_checkpoint(*_fresh()) == (8, 80)
    out = capsys.readouterr().out
    assert f"WARNING: non-persistent checkpoints {non_persistent}: the newest, iteration 9" in out, out
    assert f"{damaged} is truncated or damaged" in out and f"loading iteration 8 of --load {args.load} instead" in out
    # Both damaged: an error naming both.
    os.truncate(Path(args.load) / "iter_0000008" / "mp_rank_00" / "model_optim_rng.pt", 100)
    shutil.rmtree(Path(args.load) / "iter_0000004")
    with pytest.raises(CheckpointIntegrityError, match=f"no complete checkpoint to load: non-persistent checkpoints "
                                                       f"{non_persistent}: .*iter_0000009.*; --load {args.load}: .*"
                                                       f"iter_0000008"):
        load_checkpoint(*_fresh())


def test_non_persistent_flags_are_validated(monkeypatch):
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "3", "--lr", "1e-3",
            "--mock-data", "--save", "/tmp/x", "--save-interval", "5"]
    for extra, message in (
            (["--non-persistent-save-interval", "2"], "requires --non-persistent-ckpt-type global"),
            (["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "local"],
             "--non-persistent-ckpt-type local is not available"),
            (["--non-persistent-ckpt-type", "in_memory"], "--non-persistent-ckpt-type in_memory is not available"),
            (["--non-persistent-global-ckpt-dir", "/tmp/y"], "--non-persistent-global-ckpt-dir only applies")):
        with pytest.raises(ValueError, match=message):
            validate_args(parse_args(args=base + extra))
    args = validate_args(parse_args(args=base + ["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type",
                                                 "global", "--non-persistent-global-ckpt-dir", "/tmp/y",
                                                 "--no-verify-checkpoint"]))
    assert (args.non_persistent_save_interval, args.non_persistent_global_ckpt_dir, args.no_verify_checkpoint) == \
        (2, "/tmp/y", True)


# ---------------------------------------------------------------------------------------------------
# End-to-end drills: pretrain_gpt.py killed with SIGKILL inside a save, stopped with SIGTERM
# ---------------------------------------------------------------------------------------------------

_E2E = ["--micro-batch-size", "2", "--train-iters", "6", "--eval-iters", "0", "--split", "100,0,0"]


class _Job:
    """The ``nproc`` ranks of pretrain_gpt.py as independent processes (torchrun's environment variables, no
    torchrun: a signal reaches each rank as SLURM's scancel sends it, and each rank's exit status is its own)."""

    def __init__(self, nproc, flags, shared_data, data_prefix, tmp_path, env=None):
        argv = [sys.executable, *_pretrain_argv(flags, shared_data, data_prefix, tmp_path)]
        argv[1] = "tests/faulty_pretrain.py"  # pretrain_gpt.py with the MEGATRON_TEST_* hooks
        port = free_port()
        self.procs, self.logs = [], []
        run = len(list(tmp_path.glob("run*_rank0.log")))
        for rank in range(nproc):
            rank_env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                            LOCAL_WORLD_SIZE=str(nproc), **(env or {}))
            log = open(tmp_path / f"run{run}_rank{rank}.log", "w+")  # a file: no rank blocks on a full pipe
            self.logs.append(log)
            self.procs.append(subprocess.Popen(argv, cwd=REPO, env=rank_env, stdout=log, stderr=subprocess.STDOUT))

    def signal(self, sig):
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(sig)

    def wait_for(self, path, what):
        """Wait until ``path`` exists (the hooks create it); a job that ends first fails the test."""
        while not path.exists():
            ended = [proc.returncode for proc in self.procs if proc.poll() is not None]
            assert not ended, f"the job ended (statuses {ended}) before {what}\n{self.output()[-4000:]}"
            time.sleep(0.05)

    def output(self):
        texts = []
        for log in self.logs:
            log.flush()
            log.seek(0)
            texts.append(log.read())
        return "\n".join(texts)

    def finish(self, expect=0):
        """Wait for every rank; assert each exited with ``expect``; returns rank 0's output then the others'."""
        try:
            statuses = [proc.wait(timeout=240) for proc in self.procs]
        finally:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        out = self.output()
        for log in self.logs:
            log.close()
        assert statuses == [expect] * len(self.procs), f"exit statuses {statuses}\n{out[-4000:]}"
        return out


@pytest.fixture(scope="module")
def uninterrupted(shared_data, shakespeare_prefix, tmp_path_factory):
    """Printed losses of 6 iterations on 2 ranks without interruption: {iteration: loss string}."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    return losses_from_log(_Job(2, _E2E, shared_data, shakespeare_prefix, tmp_path).finish())


@pytest.mark.parametrize("ckpt_format,kind", [("torch", "persistent"), ("torch_dist", "persistent"),
                                              ("torch_dist_async", "persistent"), ("torch_dist", "non_persistent")])
def test_sigkill_inside_a_save_then_restart_reaches_the_same_loss(shared_data, shakespeare_prefix, tmp_path,
                                                                 uninterrupted, ckpt_format, kind):
    """Kill every rank (SIGKILL) while the save of iteration 4 is writing (with --async-save: in the background
    while training goes on): the tracker names 2, which loads; re-running the same command resumes from 2 and
    prints the uninterrupted losses. ``non_persistent``: the saves every 2 iterations are
    --non-persistent-save-interval ones (no persistent checkpoint before the end), and the restart resumes
    from the non-persistent directory (the non-persistent legacy format is covered in-process above)."""
    ckpt = tmp_path / "ckpt"
    flags = _E2E + ["--save", str(ckpt), "--load", str(ckpt), *FORMATS[ckpt_format]]
    if kind == "persistent":
        flags += ["--save-interval", "2"]
        saves = ckpt
    else:
        flags += ["--save-interval", "100", "--non-persistent-save-interval", "2", "--non-persistent-ckpt-type",
                  "global"]
        saves = ckpt / "non_persistent"
    marker = tmp_path / "in_write"
    job = _Job(2, flags, shared_data, shakespeare_prefix, tmp_path,
               env={"MEGATRON_TEST_SLEEP_IN_SAVE": "600", "MEGATRON_TEST_HOOK_ITERATION": "4",
                    "MEGATRON_TEST_HOOK_MARKER": str(marker)})
    try:
        job.wait_for(marker, "the save of iteration 4 started writing")
    finally:
        job.signal(signal.SIGKILL)
    job.finish(expect=-signal.SIGKILL)
    assert _tracker(saves) == "2"
    assert not (saves / "iter_0000004").exists()
    assert [e for e in os.listdir(saves) if e.startswith(".iter_0000004.tmp-")]  # the killed save's files

    resumed = _Job(2, flags, shared_data, shakespeare_prefix, tmp_path).finish()
    assert "successfully loaded checkpoint from" in resumed and "at iteration 2" in resumed
    losses = losses_from_log(resumed)
    assert sorted(losses) == [3, 4, 5, 6]
    assert losses == {it: uninterrupted[it] for it in losses}
    assert _tracker(ckpt) == "6" and not [e for e in os.listdir(ckpt) if e.startswith(".")]
    if kind == "non_persistent":
        assert sorted(os.listdir(saves)) == ["iter_0000006", "latest_checkpointed_iteration.txt"]  # newest only
        return
    # The files this format wrote (in the background with --async-save) match their manifests; a bit flip
    # in the newest and a truncation in the next are named, and the load falls back past them.
    assert checkpoint_integrity.choose_checkpoint(str(ckpt), warn=lambda message: None) == (str(ckpt), 6, False)
    for iteration, damage in ((6, "flip"), (4, "truncate")):
        directory = ckpt / f"iter_{iteration:07d}"
        largest = max((p for p in directory.rglob("*") if p.is_file() and p.name != "integrity_manifest.json"),
                      key=lambda p: p.stat().st_size)
        if damage == "flip":
            with open(largest, "r+b") as f:
                f.seek(largest.stat().st_size // 2)
                byte = f.read(1)[0]
                f.seek(largest.stat().st_size // 2)
                f.write(bytes([byte ^ 0x01]))
        else:
            os.truncate(largest, largest.stat().st_size - 1)
        warnings = []
        assert checkpoint_integrity.choose_checkpoint(str(ckpt), warn=warnings.append) == \
            (str(ckpt), iteration - 2, False)
        assert f"iteration 6 ({ckpt / 'iter_0000006'}) is incomplete or corrupt" in warnings[0], warnings
        assert f"iteration {iteration} ({directory}) is incomplete or corrupt ({largest} is " in warnings[0], warnings
        assert f"loading iteration {iteration - 2} ({ckpt / f'iter_{iteration - 2:07d}'})" in warnings[0], warnings
    assert f"{largest} is truncated or damaged" in warnings[0] and " is corrupt: CRC-32 " in warnings[0]


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist_async"])
def test_sigterm_with_exit_signal_handler_saves_exits_0_and_restart_continues_exactly(
        shared_data, shakespeare_prefix, tmp_path, uninterrupted, ckpt_format):
    """SIGTERM to every rank while rank 0 is inside the save of iteration 2 (held there until the signal is
    sent, so it arrives at a known point): every rank agrees at the next iteration boundary (3), saves,
    exits 0; re-running the same command continues with the uninterrupted losses. With --async-save rank 0's
    background write is held instead while training goes on, so the boundary is 3, 4 or 5 (the save of 4
    waits for the held one); the exit save is published before the ranks exit."""
    ckpt = tmp_path / "ckpt"
    flags = _E2E + ["--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2", *FORMATS[ckpt_format],
                    "--exit-signal-handler"]
    marker = tmp_path / "in_write"
    release = tmp_path / "release"
    job = _Job(2, flags, shared_data, shakespeare_prefix, tmp_path,
               env={"MEGATRON_TEST_SLEEP_IN_SAVE": "600", "MEGATRON_TEST_HOOK_ITERATION": "2",
                    "MEGATRON_TEST_HOOK_RANK": "0", "MEGATRON_TEST_HOOK_MARKER": str(marker),
                    "MEGATRON_TEST_HOOK_RELEASE": str(release)})
    try:
        job.wait_for(marker, "the save of iteration 2 started writing")
        job.signal(signal.SIGTERM)
    finally:
        release.touch()  # the save of iteration 2 goes on once the signal is sent
    out = job.finish(expect=0)
    assert "exiting program after receiving SIGTERM." in out
    stopped_at = int(_tracker(ckpt))
    if ckpt_format == "torch_dist_async":
        assert 3 <= stopped_at <= 5, out[-3000:]
    else:
        assert stopped_at == 3, out[-3000:]  # the save of 2 completes; the boundary after iteration 3 saves
    assert not [e for e in os.listdir(ckpt) if e.startswith(".")]  # every save was published

    losses = losses_from_log(_Job(2, flags, shared_data, shakespeare_prefix, tmp_path).finish())
    assert sorted(losses) == list(range(stopped_at + 1, 7))
    assert losses == {it: uninterrupted[it] for it in losses}


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch_dist_async"])
def test_full_disk_during_a_torch_dist_save_stops_with_a_clear_error_and_keeps_the_previous(
        shared_data, shakespeare_prefix, tmp_path, ckpt_format):
    """ENOSPC (injected) while writing iteration 4 (with --async-save: in the background, reported at the
    publish): every rank stops with an error naming the disk and the iteration; the tracker still names 2,
    whose files verify, and no temporary directory is left."""
    ckpt = tmp_path / "ckpt"
    flags = _E2E + ["--save", str(ckpt), "--save-interval", "2", *FORMATS[ckpt_format]]
    job = _Job(2, flags, shared_data, shakespeare_prefix, tmp_path,
               env={"MEGATRON_TEST_ENOSPC_IN_SAVE": "1", "MEGATRON_TEST_HOOK_ITERATION": "4"})
    statuses = [proc.wait(timeout=240) for proc in job.procs]
    out = job.output()
    assert all(status != 0 for status in statuses), (statuses, out[-3000:])
    assert "No space left on device" in out and "saving checkpoint at iteration 4" in out, out[-3000:]
    assert "the previous checkpoint and tracker were left unchanged" in out, out[-3000:]
    assert _tracker(ckpt) == "2"
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert checkpoint_integrity.choose_checkpoint(str(ckpt), warn=lambda message: None) == (str(ckpt), 2, False)
