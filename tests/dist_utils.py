"""Run a test function in several gloo processes on CPU and collect each rank's return value."""
import os
import pickle
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except Exception:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size, *args, timeout=300):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned gloo processes.

    ``fn`` must be a module-level (picklable) function. Returns the list of return values
    indexed by rank. Raises AssertionError carrying the child traceback if any rank fails,
    and TimeoutError if the ranks do not finish within ``timeout`` seconds.
    """
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
