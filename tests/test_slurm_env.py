"""megatron/training/slurm.py: SLURM_* (faked) -> torch.distributed's rank variables and torchrun's c10d flags."""
import os
import stat
import subprocess
import sys

import pytest

from megatron.training.slurm import SlurmEnvironmentError, expand_nodelist, torch_env_from_slurm, \
    torchrun_args_from_slurm
from pretrain_utils import REPO

# Task 13 of a 4-node job with 4 tasks per node: node 3 (node07), local task 1.
JOB = {"SLURM_JOB_ID": "918273", "SLURM_JOB_NODELIST": "node[01-03,07]", "SLURM_JOB_NUM_NODES": "4",
       "SLURM_NTASKS": "16", "SLURM_TASKS_PER_NODE": "4(x4)", "SLURM_PROCID": "13", "SLURM_LOCALID": "1",
       "SLURM_NODEID": "3"}


def test_compressed_nodelist_expands_in_order():
    assert expand_nodelist("node[01-03,07]") == ["node01", "node02", "node03", "node07"]
    assert expand_nodelist("gpu[003-004],cpu1") == ["gpu003", "gpu004", "cpu1"]
    assert expand_nodelist("single-host") == ["single-host"]


def test_task_environment_from_slurm_variables():
    assert torch_env_from_slurm(JOB) == {
        "RANK": "13", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "NODE_RANK": "3",
        "MASTER_ADDR": "node01", "MASTER_PORT": str(10000 + 918273 % 50000),
    }
    # an explicit rendezvous wins; SLURM_NODELIST is the older name of SLURM_JOB_NODELIST
    older = {k: v for k, v in JOB.items() if k != "SLURM_JOB_NODELIST"}
    env = torch_env_from_slurm(dict(older, SLURM_NODELIST="gpu[5-6]", MASTER_PORT="29400"))
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("gpu5", "29400")
    assert torch_env_from_slurm(dict(JOB, MASTER_ADDR="10.0.0.9"))["MASTER_ADDR"] == "10.0.0.9"


def test_uneven_tasks_per_node():
    env = dict(JOB, SLURM_TASKS_PER_NODE="4(x2),3,2", SLURM_NTASKS="13", SLURM_PROCID="12", SLURM_NODEID="3")
    assert torch_env_from_slurm(env)["LOCAL_WORLD_SIZE"] == "2"
    assert torch_env_from_slurm(dict(env, SLURM_NODEID="2", SLURM_PROCID="9"))["LOCAL_WORLD_SIZE"] == "3"


def test_torchrun_flags_for_one_task_per_node():
    assert torchrun_args_from_slurm(JOB) == [
        "--nnodes", "4", "--node_rank", "3", "--rdzv_id", "918273", "--rdzv_backend", "c10d",
        "--rdzv_endpoint", f"node01:{10000 + 918273 % 50000}"]


@pytest.mark.parametrize("change, named", [
    ({"SLURM_PROCID": None}, "SLURM_PROCID"),
    ({"SLURM_NTASKS": "many"}, "SLURM_NTASKS='many'"),
    ({"SLURM_PROCID": "16"}, "outside SLURM_NTASKS"),
    ({"SLURM_JOB_NODELIST": ""}, "SLURM_JOB_NODELIST"),
    ({"SLURM_JOB_NODELIST": "node[03-"}, "not a node list"),
    ({"SLURM_TASKS_PER_NODE": "4(y4)"}, "SLURM_TASKS_PER_NODE"),
    ({"SLURM_JOB_ID": None}, "SLURM_JOB_ID"),
])
def test_bad_slurm_variables_are_named(change, named):
    env = {k: v for k, v in dict(JOB, **change).items() if v is not None}
    with pytest.raises(SlurmEnvironmentError, match=named.replace("[", r"\[").replace("(", r"\(")):
        torch_env_from_slurm(env)


def test_scontrol_is_used_without_python_hostlist(monkeypatch, tmp_path):
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && printf 'a01\\na02\\n'\n")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setitem(sys.modules, "hostlist", None)  # import hostlist -> ImportError
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert expand_nodelist("a[01-02]") == ["a01", "a02"]
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(SlurmEnvironmentError, match="python-hostlist"):
        expand_nodelist("a[01-02]")


def test_command_line_sets_the_rank_variables_and_runs_the_script(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import os, sys; print(os.environ['RANK'], os.environ['MASTER_ADDR'], *sys.argv[1:])")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RANK"))}
    env.update(JOB)
    run = subprocess.run([sys.executable, "-m", "megatron.training.slurm", str(script), "--x", "1"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=60)
    assert run.stdout.split() == ["13", "node01", "--x", "1"], run.stderr
    flags = subprocess.run([sys.executable, "-m", "megatron.training.slurm", "--torchrun-args"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=60)
    assert flags.stdout.split() == torchrun_args_from_slurm(JOB)
    del env["SLURM_NODEID"]
    missing = subprocess.run([sys.executable, "-m", "megatron.training.slurm", str(script)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and missing.stderr.strip() == "error: SLURM_NODEID is not set: run this under " \
                                                                  "srun / sbatch"
