"""Test helper (not a test): pretrain_gpt.py with a fault-injecting checkpoint storage, for the checkpoint fault drills.

Run like pretrain_gpt.py (same flags). It installs :class:`FaultyStorage` (through the storage seam of
megatron/training/checkpointing/durable.py), which acts on these environment variables at the named steps
of every save; then it runs pretrain_gpt.py's main. Production code has no such hooks.

``MEGATRON_TEST_SLEEP_IN_SAVE=SECONDS``
    after this rank wrote its files into the temporary directory and before it reports success, create
    the file named by ``MEGATRON_TEST_HOOK_MARKER`` (if set) and sleep (a test kills the job meanwhile),
    at most SECONDS, less once the file named by ``MEGATRON_TEST_HOOK_RELEASE`` (if set) exists.
``MEGATRON_TEST_ENOSPC_IN_SAVE=1``
    at the same point, raise ``OSError(ENOSPC)`` as a full disk would.
``MEGATRON_TEST_CRASH_AT=POINT``
    SIGKILL this process at POINT: ``in_write`` (as above), ``before_publish`` (all ranks wrote, before
    the manifest), ``between_renames`` (rank 0: old directory moved aside or swapped, new one not yet in
    place or the old not yet removed), ``before_tracker`` (rank 0: directory in place, tracker not yet
    replaced). The marker file is created first here too.
``MEGATRON_TEST_HOOK_ITERATION=N``
    the hooks act only in the save of iteration N (default: every save).
``MEGATRON_TEST_HOOK_RANK=R``
    the hooks act only on global rank R (default: every rank).
``MEGATRON_TEST_NO_RENAME_EXCHANGE=1``
    publish with the fallback (move the old directory aside) even where ``renameat2(RENAME_EXCHANGE)`` works.

In-process tests call :func:`install` themselves (after setting the variables).
"""
import errno
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.training.checkpointing import durable  # noqa: E402
from megatron.training.checkpointing.collectives import world_rank  # noqa: E402


class FaultyStorage(durable.CheckpointStorage):
    """A CheckpointStorage that crashes, sleeps or reports a full disk where the MEGATRON_TEST_* variables say."""

    def exchange(self, a, b):
        if os.environ.get("MEGATRON_TEST_NO_RENAME_EXCHANGE") == "1":
            return False
        return super().exchange(a, b)

    def at(self, point, iteration=None):
        env = os.environ
        crash_at = env.get("MEGATRON_TEST_CRASH_AT")
        sleep = env.get("MEGATRON_TEST_SLEEP_IN_SAVE")
        enospc = env.get("MEGATRON_TEST_ENOSPC_IN_SAVE")
        if not (crash_at or sleep or enospc):
            return
        wanted_iteration = env.get("MEGATRON_TEST_HOOK_ITERATION")
        if wanted_iteration is not None and iteration is not None and int(wanted_iteration) != iteration:
            return
        wanted_rank = env.get("MEGATRON_TEST_HOOK_RANK")
        if wanted_rank is not None and int(wanted_rank) != world_rank():
            return
        marker = env.get("MEGATRON_TEST_HOOK_MARKER")
        if crash_at == point:
            _touch(marker, point)
            os.kill(os.getpid(), signal.SIGKILL)
        if point != "in_write":
            return
        if enospc == "1":
            raise OSError(errno.ENOSPC, "No space left on device (injected by MEGATRON_TEST_ENOSPC_IN_SAVE)")
        if sleep:
            _touch(marker, point)
            release = env.get("MEGATRON_TEST_HOOK_RELEASE")
            deadline = time.monotonic() + float(sleep)
            while time.monotonic() < deadline and not (release and os.path.exists(release)):
                time.sleep(0.05)


def _touch(marker, point):
    if marker:
        with open(marker, "a") as f:
            f.write(f"{point} rank {world_rank()} pid {os.getpid()}\n")


def install():
    """Install a FaultyStorage for every later save of this process; returns the storage it replaced."""
    return durable.set_storage(FaultyStorage())


if __name__ == "__main__":
    install()
    import pretrain_gpt

    sys.argv[0] = str(Path(pretrain_gpt.__file__))
    pretrain_gpt.main()
