"""Run a test function in several gloo processes on CPU and collect each rank's return value; start
the ranks of a script from the preloaded fork server (``fork_server.py``) instead of fresh interpreters."""
import atexit
import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

import torch.multiprocessing as mp

TESTS = Path(__file__).resolve().parent
# The environment before any test changed it: the fork server imports torch in it (OMP_NUM_THREADS=1 as
# every launch here sets), and each launch then passes its own environment to its ranks.
_SERVER_ENV = dict(os.environ, OMP_NUM_THREADS="1")


@contextlib.contextmanager
def single_rank_process_group():
    """A one-rank gloo default group with Megatron's parallel groups on it, in this process, for the
    body; pytest.skip if a group already exists here. Destroys both on exit."""
    import pytest
    import torch.distributed as dist

    from megatron.core import parallel_state

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def use_torchrun() -> bool:
    """PRETRAIN_TESTS_TORCHRUN=1: start ranks as fresh processes (torchrun, multiprocessing spawn), as
    before the fork server, e.g. to rule it out when a multi-process test fails."""
    return os.environ.get("PRETRAIN_TESTS_TORCHRUN", "0") not in ("", "0")


class _ForkServer:
    """The pytest process's handle on one ``fork_server.py`` process (started on first use)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc = self._sock = None

    def _start(self):
        ours, theirs = socket.socketpair()
        # The server's own output (a failed preload, a crash): kept only when not empty.
        log = open(Path(tempfile.gettempdir()) / f"fork_server_{os.getpid()}.log", "w")
        self._log = Path(log.name)
        self._proc = subprocess.Popen([sys.executable, str(TESTS / "fork_server.py"), str(theirs.fileno())],
                                      pass_fds=[theirs.fileno()], env=_SERVER_ENV, cwd=TESTS.parent,
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        theirs.close()
        log.close()
        self._sock = ours
        ours.settimeout(300)  # preloading torch and megatron on a busy 2-core machine
        ready = self._recv()
        ours.settimeout(None)
        if ready is None or "ready" not in ready:
            raise RuntimeError(f"tests/fork_server.py did not start (log: {log.name})")
        atexit.register(self.close)

    def _recv(self):
        from fork_server import recv

        return recv(self._sock)

    def close(self):
        if self._sock is not None:
            self._sock.close()  # EOF: the server exits
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._proc = None
            try:
                if self._log.stat().st_size == 0:
                    self._log.unlink()
            except OSError:
                pass

    def launch(self, request: dict, timeout: float) -> list:
        """Fork the ranks of ``request`` (see fork_server.py) and wait for them: their exit statuses.

        On ``timeout`` the ranks' process groups are killed and ``subprocess.TimeoutExpired`` raised. Any
        other interruption (pytest-timeout, KeyboardInterrupt) kills them too before it propagates.
        """
        from fork_server import send

        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            send(self._sock, request)
            pids = self._recv()["pids"]
            try:
                self._sock.settimeout(max(timeout, 0.001))
                reply = self._recv()
            except socket.timeout:
                self._kill(pids)
                raise subprocess.TimeoutExpired(request.get("argv") or "run_distributed", timeout) from None
            except BaseException:
                self._kill(pids)
                raise
            finally:
                if self._sock is not None:
                    self._sock.settimeout(None)
            if reply is None:
                self.close()
                raise RuntimeError("tests/fork_server.py exited during a launch")
            return reply["statuses"]

    def _kill(self, pids):
        """SIGKILL the ranks' process groups and take the server's answer for them off the socket (or,
        failing that, stop the server: the next launch starts a new one)."""
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self._sock.settimeout(60)
            if self._recv() is not None:
                return
        except BaseException:
            pass
        self._proc.kill()
        self.close()


_SERVER = _ForkServer()


def fork_ranks(nproc: int, argv: list, envs: list, cwd, stdout: list, stderr: list, timeout: float,
               stop_others_on_failure: bool = True) -> list:
    """Run ``python argv...`` on ``nproc`` ranks forked from the preloaded fork server: rank ``r`` gets
    environment ``envs[r]``, writes to the files ``stdout[r]`` and ``stderr[r]`` (the same path: one
    file). Returns the exit statuses by rank (negative: killed by that signal); raises
    ``subprocess.TimeoutExpired`` after ``timeout`` seconds, the ranks killed.

    ``stop_others_on_failure``: as torchrun does, the first rank to fail gets the others terminated.
    """
    return _SERVER.launch(dict(kind="script", nproc=nproc, argv=[str(a) for a in argv], env=envs, cwd=str(cwd),
                               stdout=[str(p) for p in stdout], stderr=[str(p) for p in stderr],
                               stop_others_on_failure=stop_others_on_failure), timeout)


def rank_env(base: dict, rank: int, world_size: int, port: int, **extra) -> dict:
    """``base`` plus the variables torchrun sets for a rank on one node."""
    return dict(base, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), **extra)


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Plain pickle bytes: a tensor put on a torch.multiprocessing queue travels as a shared-memory
        # handle that the parent fetches from this process, which may have exited by then.
        result = pickle.dumps(fn(rank, world_size, *args))
        queue.put((rank, "ok", result))
    except BaseException:  # report any failure to the parent, which re-raises it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        from fork_server import destroy_process_groups

        destroy_process_groups()


def run_distributed(fn, world_size, *args, timeout=300):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes.

    ``fn`` must be a module-level (picklable) function. Returns the list of return values
    indexed by rank. Raises AssertionError carrying the child traceback if any rank fails,
    and TimeoutError if the ranks do not finish within ``timeout`` seconds.

    The ranks are forked from the fork server (torch and megatron already imported) with this
    process's environment and ``sys.path``, as spawned processes would get them; with
    PRETRAIN_TESTS_TORCHRUN=1 they are spawned.
    """
    if use_torchrun():
        return _run_spawned(fn, world_size, *args, timeout=timeout)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="run_distributed_") as tmp:
        tmp = Path(tmp)
        logs = [tmp / f"rank{r}.log" for r in range(world_size)]
        results = [tmp / f"rank{r}.result" for r in range(world_size)]
        env = dict(os.environ)
        request = dict(kind="function", nproc=world_size, payload=pickle.dumps((fn, args)),
                       env=[rank_env(env, r, world_size, port) for r in range(world_size)], cwd=os.getcwd(),
                       sys_path=list(sys.path), stdout=[str(p) for p in logs], stderr=[str(p) for p in logs],
                       results=[str(p) for p in results], stop_others_on_failure=True)
        try:
            statuses = _SERVER.launch(request, timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"timed out after {timeout}s waiting for ranks\n" + _tails(logs)) from None
        outcomes = {}
        for rank, path in enumerate(results):
            if path.exists():
                with open(path, "rb") as f:
                    outcomes[rank] = pickle.load(f)
        errors = [f"rank {r} failed:\n{payload}" for r, (kind, payload) in sorted(outcomes.items()) if kind == "error"]
        errors += [f"rank {r} exited with status {statuses[r]} and no result (negative: killed by that signal; "
                   f"{-signal.SIGTERM} when stopped after another rank failed)" for r in range(world_size)
                   if r not in outcomes]
        if errors:
            raise AssertionError("\n".join(errors) + "\n" + _tails(logs))
        return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


def _tails(logs, chars=3000) -> str:
    """The end of each rank's output, for a failure message."""
    return "".join(f"--- rank {r} output (end) ---\n{log.read_text(errors='replace')[-chars:]}\n"
                   for r, log in enumerate(logs) if log.exists() and log.stat().st_size)


def _run_spawned(fn, world_size, *args, timeout=300):
    """run_distributed with ``multiprocessing`` spawn (PRETRAIN_TESTS_TORCHRUN=1)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    except Exception as exc:  # queue.Empty on timeout
        errors.append(f"timed out after {timeout}s waiting for ranks ({exc!r})")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
