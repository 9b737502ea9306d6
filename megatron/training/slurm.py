"""Launch environment from SLURM: torch.distributed's variables (one task per GPU), torchrun's flags, this process's rank.

Under ``srun`` every task is one rank: ``python -m megatron.training.slurm pretrain_gpt.py FLAGS...`` sets
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` from ``SLURM_*`` and replaces itself with ``python pretrain_gpt.py FLAGS...``.
With one task per node that starts ``torchrun``, ``python -m megatron.training.slurm --torchrun-args``
prints ``--nnodes N --node_rank R --rdzv_id JOB --rdzv_backend c10d --rdzv_endpoint HOST:PORT``.

The rendezvous host is the first node of ``SLURM_JOB_NODELIST`` (compressed lists such as
``node[01-03,07]`` are expanded with python-hostlist, else with ``scontrol show hostnames``); the port is
``MASTER_PORT`` when set, else derived from ``SLURM_JOB_ID`` so that two jobs sharing a node differ.
"""
import os
import re
import shutil
import subprocess
import sys
from typing import List, Mapping


class SlurmEnvironmentError(ValueError):
    """A SLURM variable this launch needs is missing or malformed; the message names it."""


def expand_nodelist(nodelist: str) -> List[str]:
    """Host names of a SLURM node list, in order: ``"node[01-03,07]"`` -> ``node01 node02 node03 node07``.

    Uses python-hostlist's ``expand_hostlist`` (``pip install python-hostlist``, in the ``slurm`` extras),
    else ``scontrol show hostnames``. Raises SlurmEnvironmentError for an empty or unparsable list, or
    when neither tool is present.
    """
    nodelist = nodelist.strip()
    if not nodelist:
        raise SlurmEnvironmentError("SLURM_JOB_NODELIST is empty: cannot pick the rendezvous host")
    try:
        import hostlist
    except ImportError:
        hostlist = None
    if hostlist is not None:
        try:
            hosts = hostlist.expand_hostlist(nodelist)
        except hostlist.BadHostlist as error:
            raise SlurmEnvironmentError(f"SLURM_JOB_NODELIST={nodelist!r} is not a node list: {error}") from None
    elif shutil.which("scontrol"):
        result = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if result.returncode != 0:
            raise SlurmEnvironmentError(f"scontrol show hostnames {nodelist!r} failed: {result.stderr.strip()}")
        hosts = result.stdout.split()
    else:
        raise SlurmEnvironmentError("expanding SLURM_JOB_NODELIST needs python-hostlist (pip install "
                                    "python-hostlist) or SLURM's scontrol on PATH")
    if not hosts:
        raise SlurmEnvironmentError(f"SLURM_JOB_NODELIST={nodelist!r} names no host")
    return hosts


def _int(env: Mapping[str, str], *names: str) -> int:
    """The first of ``names`` present in ``env`` as an int. Raises SlurmEnvironmentError naming them."""
    for name in names:
        value = env.get(name)
        if value is not None and value.strip():
            try:
                return int(value)
            except ValueError:
                raise SlurmEnvironmentError(f"{name}={value!r} is not an integer") from None
    raise SlurmEnvironmentError(f"{' or '.join(names)} is not set: run this under srun / sbatch")


def _tasks_on_this_node(env: Mapping[str, str], node_rank: int) -> int:
    """Tasks on node ``node_rank`` from ``SLURM_TASKS_PER_NODE`` (e.g. ``"4(x2),3"``), else SLURM_NTASKS_PER_NODE."""
    spec = env.get("SLURM_TASKS_PER_NODE", "").strip()
    if not spec:
        return _int(env, "SLURM_NTASKS_PER_NODE")
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise SlurmEnvironmentError(f"SLURM_TASKS_PER_NODE={spec!r} is not SLURM's 'N(xM),...' form")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if node_rank >= len(counts):
        raise SlurmEnvironmentError(f"SLURM_NODEID={node_rank} but SLURM_TASKS_PER_NODE={spec!r} covers "
                                    f"{len(counts)} node(s)")
    return counts[node_rank]


def rendezvous_address(env: Mapping[str, str]) -> tuple:
    """``(host, port)``: MASTER_ADDR or the first node of SLURM_JOB_NODELIST (SLURM_NODELIST), and
    MASTER_PORT or ``10000 + SLURM_JOB_ID % 50000`` (the port ``pretrain_gpt.py`` itself derives under srun)."""
    host = env.get("MASTER_ADDR") or expand_nodelist(env.get("SLURM_JOB_NODELIST") or
                                                     env.get("SLURM_NODELIST", ""))[0]
    port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else 10000 + _int(env, "SLURM_JOB_ID") % 50000
    return host, port


def torch_env_from_slurm(env: Mapping[str, str]) -> dict:
    """torch.distributed's variables for this srun task (one task = one rank = one GPU).

    Returns ``{RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT}`` as
    strings, from SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_TASKS_PER_NODE, SLURM_NODEID and
    ``rendezvous_address``. Raises SlurmEnvironmentError naming a missing or malformed variable.
    """
    rank, world_size = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    if not 0 <= rank < world_size:
        raise SlurmEnvironmentError(f"SLURM_PROCID={rank} is outside SLURM_NTASKS={world_size}")
    node_rank = _int(env, "SLURM_NODEID")
    host, port = rendezvous_address(env)
    return {
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(_int(env, "SLURM_LOCALID")),
        "LOCAL_WORLD_SIZE": str(_tasks_on_this_node(env, node_rank)), "NODE_RANK": str(node_rank),
        "MASTER_ADDR": host, "MASTER_PORT": str(port),
    }


def torchrun_args_from_slurm(env: Mapping[str, str]) -> List[str]:
    """torchrun's multi-node flags for a job with one task (one torchrun) per node: the c10d rendezvous form.

    ``--nnodes`` from SLURM_JOB_NUM_NODES (SLURM_NNODES), ``--node_rank`` from SLURM_NODEID, ``--rdzv_id`` from
    SLURM_JOB_ID, ``--rdzv_endpoint`` from ``rendezvous_address``. Raises SlurmEnvironmentError.
    """
    host, port = rendezvous_address(env)
    return ["--nnodes", str(_int(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES")),
            "--node_rank", str(_int(env, "SLURM_NODEID")), "--rdzv_id", str(_int(env, "SLURM_JOB_ID")),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{host}:{port}"]


def _env_int(name, default):
    value = os.getenv(name)
    if value is None or value.strip() == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def launcher_rank_and_world_size() -> tuple:
    """This process's ``(rank, world size)`` as the launcher set them: torchrun's RANK/WORLD_SIZE, else
    (plain ``srun``, which sets only SLURM's) SLURM_PROCID/SLURM_NTASKS; ``(0, 1)`` without either.
    Raises ValueError naming a variable that is not an integer."""
    if os.getenv("RANK") is None and os.getenv("WORLD_SIZE") is None and os.getenv("SLURM_NTASKS") is not None:
        return _env_int("SLURM_PROCID", 0), _env_int("SLURM_NTASKS", 1)
    return _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)


def default_local_rank() -> int:
    """``--local-rank``'s default: LOCAL_RANK, else SLURM_LOCALID under plain ``srun``, else 0."""
    if os.getenv("LOCAL_RANK") is None and os.getenv("SLURM_LOCALID") is not None and os.getenv("RANK") is None:
        return _env_int("SLURM_LOCALID", 0)
    return _env_int("LOCAL_RANK", 0)


def main(argv=None) -> None:
    """``--torchrun-args``: print torchrun's flags; ``--print-env``: print ``export`` lines; else exec
    ``python SCRIPT ARGS...`` with the rank variables set. Exits 2 with one line on a SLURM variable error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["--torchrun-args"]:
            print(" ".join(torchrun_args_from_slurm(os.environ)))
            return
        variables = torch_env_from_slurm(os.environ)
        if argv[:1] == ["--print-env"]:
            print("\n".join(f"export {name}={value}" for name, value in variables.items()))
            return
    except SlurmEnvironmentError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    if not argv:
        print("usage: python -m megatron.training.slurm (--torchrun-args | --print-env | SCRIPT [ARGS...])",
              file=sys.stderr)
        sys.exit(2)
    os.environ.update(variables)
    os.execv(sys.executable, [sys.executable, *argv])


if __name__ == "__main__":
    main()
