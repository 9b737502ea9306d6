"""The launch examples train on CPU with tiny settings and agree: two torchrun launchers (--nnodes 2, c10d
rendezvous and the static --node_rank/--master_addr form) on 127.0.0.1, and the SLURM script under a fake
srun, log the losses of one launcher with 2 processes."""
import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest

from reference_data import require_shared_data
from dist_utils import free_port
from pretrain_utils import REPO, losses_from_log

TINY = dict(NUM_LAYERS="2", HIDDEN_SIZE="32", NUM_HEADS="4", SEQ_LENGTH="32", MICRO_BATCH_SIZE="2",
            GLOBAL_BATCH_SIZE="4", TRAIN_ITERS="3", WARMUP_ITERS="1", PRECISION="", TP="1", OMP_NUM_THREADS="1")
EXTRA_FLAGS = ["--log-interval", "1", "--eval-iters", "0", "--seed", "1234"]
LAUNCH_TIMEOUT_S = 240


def _env(tmp_path, name, **overrides):
    shared_data = require_shared_data()  # the GPT-2 vocabulary and merges; skips the test without them
    env = dict(os.environ, **TINY, CHECKPOINT_DIR=str(tmp_path / name / "ckpt"),
               TENSORBOARD_DIR=str(tmp_path / name / "tb"), VOCAB_FILE=str(shared_data / "gpt2-vocab.json"),
               MERGE_FILE=str(shared_data / "gpt2-merges.txt"))
    env.pop("DATA_PATH", None)
    env.update(overrides)
    return env


def _run_together(commands, tmp_path):
    """Start every ``(argv, env)`` at once, each in its own process group with its output in a file; wait for
    all (killing every group on timeout or failure). Returns the outputs; fails the test on a non-zero exit."""
    procs, logs = [], []
    try:
        for i, (argv, env) in enumerate(commands):
            logs.append(tmp_path / f"launcher{i}_{free_port()}.log")
            with open(logs[-1], "w") as log:
                procs.append(subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        statuses = [proc.wait(timeout=LAUNCH_TIMEOUT_S) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    outputs = [log.read_text() for log in logs]
    for status, output in zip(statuses, outputs):
        assert status == 0, output[-4000:]
    return outputs


def _losses(outputs):
    """The loss lines of a run whose last rank may have been started by any of its launchers."""
    found = [losses_from_log(output) for output in outputs]
    found = [losses for losses in found if losses]
    assert len(found) == 1, f"expected one launcher to print the log lines, got {len(found)}"
    assert sorted(found[0]) == [1, 2, 3]
    return found[0]


@pytest.fixture(scope="module")
def one_launcher_losses(tmp_path_factory):
    """examples/pretrain_gpt3_small.sh: one torchrun, 2 processes."""
    tmp_path = tmp_path_factory.mktemp("single")
    env = _env(tmp_path, "single", GPUS_PER_NODE="2")
    return _losses(_run_together([(["bash", "examples/pretrain_gpt3_small.sh", *EXTRA_FLAGS], env)], tmp_path))


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_two_launchers_on_loopback_train_like_one(rendezvous, one_launcher_losses, tmp_path):
    """Two torchrun launchers (--nnodes 2 --nproc_per_node 1), started together: for c10d the node ranks
    go to whichever joins first, so the test reads the log lines from whichever launcher prints them."""
    port = str(free_port())
    commands = []
    for node_rank in (0, 1):
        env = _env(tmp_path, "multi", GPUS_PER_NODE="1", NNODES="2", NODE_RANK=str(node_rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RDZV=rendezvous, RDZV_ID=f"test-{port}")
        commands.append((["bash", "examples/pretrain_gpt3_small_multinode.sh", *EXTRA_FLAGS], env))
    if rendezvous == "c10d":
        commands.reverse()  # the order of start must not matter
    assert _losses(_run_together(commands, tmp_path)) == one_launcher_losses


FAKE_SRUN = textwrap.dedent('''\
    #!{python}
    """srun for tests: starts SLURM_NTASKS tasks of the command on this machine with SLURM's per-task variables."""
    import os, subprocess, sys
    argv, chdir = sys.argv[1:], None
    while argv and argv[0].startswith("--"):
        option = argv.pop(0)
        if option == "--chdir":
            chdir = argv.pop(0)
        elif "=" not in option and option not in ("--exclusive",):
            argv.pop(0)
    tasks = int(os.environ["SLURM_NTASKS"])
    procs = [subprocess.Popen(argv, cwd=chdir, env=dict(os.environ, SLURM_PROCID=str(i), SLURM_LOCALID=str(i),
                                                        SLURM_NODEID="0")) for i in range(tasks)]
    sys.exit(max(proc.wait() for proc in procs))
    ''')


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
def test_slurm_script_under_fake_srun_trains_like_one_launcher(one_launcher_losses, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN.format(python=sys.executable))
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    env = _env(tmp_path, "slurm", PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=sys.executable,
               SLURM_JOB_ID="4242", SLURM_NTASKS="2", SLURM_TASKS_PER_NODE="2", SLURM_JOB_NUM_NODES="1",
               SLURM_JOB_NODELIST="localhost", SLURM_SUBMIT_DIR=str(REPO), MASTER_PORT=str(free_port()))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        env.pop(name, None)
    outputs = _run_together([(["bash", "examples/slurm/pretrain_gpt.sbatch", *EXTRA_FLAGS], env)], tmp_path)
    assert _losses(outputs) == one_launcher_losses
