"""Fork server for the multi-process tests: imports torch and megatron once, then forks each rank.

A fresh Python process per rank spends 2-4 s of CPU importing torch and megatron before it runs a single
line of the test; on CI's 2 cores that was about half of the suite's time. This process pays it once:
:mod:`launcher` (in the pytest process) starts it with one end of a socket pair, and for each launch
it forks ``nproc`` children from its already-imported state. A child is set up as a fresh process
of the launch would be -- its own process group, its environment, working directory, ``sys.argv``,
``sys.path``, stdin from /dev/null and stdout/stderr to files, written unbuffered like ``python -u``
under torchrun -- and then either runs a script as ``__main__`` (``kind="script"``) or calls a
pickled function (``kind="function"``, :func:`dist_utils.run_distributed`).

Protocol (length-prefixed pickles on the socket): request dict -> ``{"pids": [...]}`` once the ranks
are forked -> ``{"statuses": [...]}`` when all have exited (``os.waitstatus_to_exitcode``: negative
for a signal). With ``stop_others_on_failure`` the first rank to fail gets the others SIGTERMed (their
process groups), then SIGKILLed after a grace period, as torchrun does. The client kills the ranks'
process groups itself on a timeout. The server exits on EOF or when its parent (pytest) is gone; each
rank is SIGKILLed when the server dies (PR_SET_PDEATHSIG).

Only the preloaded imports are shared: nothing here initialises torch.distributed, seeds an RNG or starts
a thread, and megatron reads its environment variables when called, not when imported.
"""
import ctypes
import io
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
import traceback

GRACE_S = 15.0  # between SIGTERM and SIGKILL for the surviving ranks of a failed launch
# What a pretrain_gpt.py rank imports by the end of its run (torch._dynamo: the first optimizer's
# constructor; tiktoken: the GPT-2 tokenizer; transformers: --tokenizer-type HuggingFaceTokenizer), the
# telemetry SDK and the tools the tests' functions use.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.profiler", "numpy", "megatron.training.training",
           "megatron.core.models.gpt", "megatron.core.datasets.gpt_dataset",
           "megatron.core.datasets.blended_megatron_dataset_builder", "megatron.core.tokenizers.gpt2_bpe",
           "tiktoken", "sentencepiece", "megatron.core.telemetry.providers", "torch.utils.tensorboard",
           "tensorboard.backend.event_processing.event_accumulator", "pytest",
           "transformers:AutoTokenizer", "transformers:PreTrainedTokenizerFast")  # "module:attribute": lazy


def send(sock, obj):
    data = pickle.dumps(obj)
    sock.sendall(struct.pack("!Q", len(data)) + data)


def recv(sock):
    """The next message, or None on EOF."""
    header = _recv_exact(sock, 8)
    if header is None:
        return None
    data = _recv_exact(sock, struct.unpack("!Q", header)[0])
    return None if data is None else pickle.loads(data)


def _recv_exact(sock, n):
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _unbuffered_stdio():
    """sys.stdout/sys.stderr on fds 1/2 as ``python -u`` makes them (raw file, write-through text layer)."""
    encoding = sys.stdout.encoding or "utf-8"
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=encoding,
                                                   errors="strict", write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=encoding,
                                                   errors="backslashreplace", write_through=True)


def _redirect(request, rank):
    """stdin from /dev/null; stdout and stderr to the rank's files (one shared open file when the same)."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    out_path, err_path = request["stdout"][rank], request["stderr"][rank]
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    out = os.open(out_path, flags, 0o644)
    err = out if err_path == out_path else os.open(err_path, flags, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {out, err}:
        os.close(fd)
    _unbuffered_stdio()


def _exit_code(exc: SystemExit) -> int:
    """The status a Python process exits with for ``sys.exit(code)``."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_script(request, rank) -> int:
    """Run ``argv[0]`` as ``__main__`` like ``python argv...`` would; returns its exit status."""
    import runpy

    argv = request["argv"]
    script = os.path.abspath(argv[0])
    sys.argv = [argv[0], *argv[1:]]
    sys.path[0] = os.path.dirname(script)  # `python script.py` puts the script's folder first
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exc:
        return _exit_code(exc)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1



def destroy_process_groups():
    """Tear down what a rank function may have left: Megatron's parallel groups, then the default group."""
    import torch.distributed as dist

    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except Exception:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


def _run_function(request, rank) -> int:
    """``fn(rank, world_size, *args)`` between init_process_group and its destruction (as
    ``dist_utils._worker`` did in a spawned process); pickles ``("ok", value)`` or ``("error", traceback)``
    to the rank's result file. Exit status 1 when ``fn`` raised, so the launch stops the other ranks."""
    sys.path[:] = request["sys_path"]
    world_size = request["nproc"]
    result_path = request["results"][rank]
    status = 0
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        try:
            fn, args = pickle.loads(request["payload"])
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
            outcome = ("ok", pickle.dumps(fn(rank, world_size, *args)))
        except BaseException:
            outcome, status = ("error", traceback.format_exc()), 1
        finally:
            destroy_process_groups()
    except BaseException:
        outcome, status = ("error", traceback.format_exc()), 1
    tmp = f"{result_path}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(outcome, f)
    os.replace(tmp, result_path)
    return status


def _finish_like_interpreter():
    """What a Python process does after its main module: join non-daemon threads, run atexit handlers."""
    import atexit

    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()


def _child(request, rank, server_pid) -> int:
    os.setpgid(0, 0)
    try:  # die with the server, so a killed pytest leaves no rank behind
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() != server_pid:
        return 1
    _redirect(request, rank)
    os.environ.clear()
    os.environ.update(request["env"][rank])
    os.chdir(request["cwd"])
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    if "numpy" in sys.modules:  # a fresh process seeds numpy's global RNG from the OS, not the server's state
        sys.modules["numpy"].random.seed()
    code = _run_script(request, rank) if request["kind"] == "script" else _run_function(request, rank)
    try:
        _finish_like_interpreter()
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        code = code or 1
    return code


def _fork_rank(sock, request, rank) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    server_pid = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        sock.close()
        code = _child(request, rank, server_pid)
    except BaseException:
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code)


def _signal_groups(pids, sig):
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_all(pids, stop_others_on_failure, parent_pid) -> list:
    """Exit statuses of ``pids`` (waited for here); see the module docstring for failures."""
    statuses, alive = {}, list(pids)
    kill_at = None
    while alive:
        for pid in list(alive):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                alive.remove(pid)
                statuses[pid] = os.waitstatus_to_exitcode(status)
                if statuses[pid] != 0 and stop_others_on_failure and kill_at is None and alive:
                    _signal_groups(alive, signal.SIGTERM)
                    kill_at = time.monotonic() + GRACE_S
        if not alive:
            break
        if kill_at is not None and time.monotonic() > kill_at:
            _signal_groups(alive, signal.SIGKILL)
            kill_at = float("inf")
        if os.getppid() != parent_pid:  # pytest is gone: take the ranks down and stop
            _signal_groups(alive, signal.SIGKILL)
            os._exit(1)
        time.sleep(0.01)
    return [statuses[pid] for pid in pids]


def main():
    sock = socket.socket(fileno=int(sys.argv[1]))
    parent_pid = os.getppid()
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo (megatron)
    import importlib

    for name in PRELOAD:
        try:
            module, _, attribute = name.partition(":")
            module = importlib.import_module(module)
            if attribute:
                getattr(module, attribute)
        except Exception as exc:  # the rank's own import reports it properly
            print(f"fork_server: preloading {name} failed: {exc!r}", file=sys.stderr, flush=True)
    del sys.path[1]
    send(sock, {"ready": os.getpid()})
    while True:
        request = recv(sock)
        if request is None:
            return
        pids = [_fork_rank(sock, request, rank) for rank in range(request["nproc"])]
        send(sock, {"pids": pids})
        send(sock, {"statuses": _wait_all(pids, request["stop_others_on_failure"], parent_pid)})


if __name__ == "__main__":
    main()
