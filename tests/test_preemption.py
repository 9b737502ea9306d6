"""Graceful preemption: --exit-signal-handler saves at the next iteration boundary and every rank exits 0,
also with DataLoader worker processes (which receive the launcher's signal too)."""
import os
import signal
import subprocess
import sys

import pytest

from pretrain_utils import REPO

pytestmark = pytest.mark.timeout(420)


def _launch(nproc, shared_data, data_prefix, tmp_path, extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(REPO / "tests" / "record_exit.py"), str(tmp_path), "pretrain_gpt.py",
           "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
           "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
           "--lr", "1e-3", "--train-iters", "100000", "--log-interval", "1", "--eval-iters", "0",
           "--data-path", data_prefix, "--split", "100,0,0", "--distributed-backend", "gloo",
           "--data-cache-path", str(tmp_path / "cache"), "--tokenizer-type", "GPT2BPETokenizer",
           "--vocab-file", str(shared_data / "gpt2-vocab.json"), "--merge-file", str(shared_data / "gpt2-merges.txt"),
           "--save", str(tmp_path / "ckpt"), "--save-interval", "1000000", "--exit-signal-handler", "--ckpt-format", "torch", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _signal_at_iteration(proc, iteration, send):
    """Read the log until iteration ``iteration`` is printed, call ``send()``, then read to the end."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if f"iteration {iteration:8d}/" in line:
            send()
            break
    lines.extend(proc.stdout)
    proc.wait(timeout=120)
    return "".join(lines)


def _check_saved_and_clean_exit(tmp_path, out, nproc, signalled_at):
    for rank in range(nproc):
        status_file = tmp_path / f"exit_rank{rank}"
        assert status_file.is_file(), f"rank {rank} never finished\n{out[-3000:]}"
        assert status_file.read_text() == "0", f"rank {rank} exit status {status_file.read_text()}\n{out[-3000:]}"
    assert "exiting program after receiving SIGTERM." in out
    assert "killed by signal" not in out, out[-3000:]
    ckpt = tmp_path / "ckpt"
    stopped_at = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert stopped_at >= signalled_at
    assert (ckpt / f"iter_{stopped_at:07d}" / "mp_rank_00" / "model_optim_rng.pt").is_file()


@pytest.mark.parametrize("target", ["torchrun", "every_process"])
def test_sigterm_with_loader_workers_saves_and_every_rank_exits_0(shared_data, shakespeare_prefix, tmp_path, target):
    """SIGTERM to torchrun (it forwards it to each rank's process group, loader workers included), or to
    every process as SLURM's scancel does: checkpoint at the next iteration boundary, each rank exits 0."""
    proc = _launch(2, shared_data, shakespeare_prefix, tmp_path, ["--num-workers", "2"])

    def send():
        if target == "torchrun":
            proc.send_signal(signal.SIGTERM)
            return
        ps = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
        children = {}
        pairs = [tuple(map(int, row.split())) for row in ps.strip().splitlines()]
        for pid, ppid in pairs:
            children.setdefault(ppid, []).append(pid)
        tree, todo = [], [proc.pid]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo.extend(children.get(pid, []))
        for pid in tree:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    try:
        out = _signal_at_iteration(proc, 3, send)
    finally:
        if proc.poll() is None:
            proc.kill()
    _check_saved_and_clean_exit(tmp_path, out, 2, 3)


@pytest.mark.parametrize("name", ["SIGKILL", "SIGSTOP", "SIGCHLD"])
def test_exit_signal_that_cannot_be_handled_is_refused(monkeypatch, name):
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setenv("WORLD_SIZE", "1")
    args = parse_args(args=["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
                            "--train-iters", "3", "--lr", "1e-3", "--mock-data", "--exit-signal", name])
    with pytest.raises(ValueError, match=f"--exit-signal {name} cannot be handled"):
        validate_args(args)


def _worker_signal_dispositions(_):
    return signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)


def test_loader_workers_ignore_the_exit_signal_only():
    """The worker processes of the loader ignore the given signal and keep the default for the others."""
    import torch

    from megatron.training.datasets.data_samplers import build_pretraining_data_loader_from

    class _Dataset(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, index):
            usr1, term = _worker_signal_dispositions(index)
            return {"usr1_ignored": torch.tensor(usr1 == signal.SIG_IGN), "term_default": torch.tensor(term == signal.SIG_DFL)}

    loader = build_pretraining_data_loader_from(_Dataset(), 0, dataloader_type="single", micro_batch_size=2,
                                                data_parallel_rank=0, data_parallel_size=1, num_workers=2, seed=1,
                                                worker_ignored_signals=(signal.SIGUSR1,))
    batches = list(loader)
    assert len(batches) == 4
    assert all(b["usr1_ignored"].all() and b["term_default"].all() for b in batches)
