"""Test helper (not a test): pretrain_gpt.py with the checkpoint fault hooks of faulty_pretrain.py plus data-fetch hooks, for the hang-report and slow-step tests.

Run like pretrain_gpt.py (same flags). Production code has no such hooks: this script patches
``GPTDataset.__getitem__`` (called inside the training data iterator's ``next``, so the rank's phase is
``data``) to act on these environment variables, then runs pretrain_gpt.py's main.

``MEGATRON_TEST_STOP_AT=ITERATION:RANK``
    in the first sample fetched for training iteration ITERATION on global rank RANK: wait until the hang
    monitor has published two heartbeats sampled in that fetch, append ``stopped rank R pid P`` to the file
    ``MEGATRON_TEST_HOOK_MARKER``, then stop this process with SIGSTOP (the test sends SIGCONT).
``MEGATRON_TEST_SLOW_DATA=ITERATION:RANK:SECONDS``
    sleep SECONDS in the first sample fetched for training iteration ITERATION on rank RANK.
``MEGATRON_TEST_SLOW_EVAL=RANK:SECONDS``
    sleep SECONDS in the first sample fetched during an evaluation on rank RANK.
The ``MEGATRON_TEST_*`` variables of faulty_pretrain.py (e.g. ``MEGATRON_TEST_SLEEP_IN_SAVE``) work too.
"""
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import faulty_pretrain  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset  # noqa: E402
from megatron.core.progress import PROGRESS  # noqa: E402

_DONE = set()


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _once(key) -> bool:
    if key in _DONE:
        return False
    _DONE.add(key)
    return True


def _hook():
    env = os.environ
    if env.get("MEGATRON_TEST_STOP_AT"):
        iteration, rank = (int(v) for v in env["MEGATRON_TEST_STOP_AT"].split(":"))
        if (rank == _rank() and PROGRESS.section == "train" and PROGRESS.iteration == iteration
                and _once("stop")):
            from megatron.training.troubleshooting import active_hang_monitor

            monitor = active_hang_monitor()
            if monitor is not None:  # the last heartbeat before the stop must show this fetch
                wanted = monitor.beats + 2
                while monitor.beats < wanted:
                    time.sleep(0.02)
            with open(env["MEGATRON_TEST_HOOK_MARKER"], "a") as f:
                f.write(f"stopped rank {rank} pid {os.getpid()}\n")
            os.kill(os.getpid(), signal.SIGSTOP)
    if env.get("MEGATRON_TEST_SLOW_DATA"):
        iteration, rank, seconds = env["MEGATRON_TEST_SLOW_DATA"].split(":")
        if (int(rank) == _rank() and PROGRESS.section == "train" and PROGRESS.iteration == int(iteration)
                and _once("slow_data")):
            time.sleep(float(seconds))
    if env.get("MEGATRON_TEST_SLOW_EVAL"):
        rank, seconds = env["MEGATRON_TEST_SLOW_EVAL"].split(":")
        if int(rank) == _rank() and PROGRESS.section == "evaluation" and _once("slow_eval"):
            time.sleep(float(seconds))


_getitem = GPTDataset.__getitem__


def _hooked_getitem(self, idx):
    _hook()
    return _getitem(self, idx)


if __name__ == "__main__":
    GPTDataset.__getitem__ = _hooked_getitem
    faulty_pretrain.install()
    import pretrain_gpt

    sys.argv[0] = str(Path(pretrain_gpt.__file__))
    pretrain_gpt.main()
