"""The tracker file (``latest_checkpointed_iteration.txt``): read safely, and the iterations of a checkpoint directory."""
import os
import re
import stat

import torch
import torch.distributed as dist

from megatron.core.collective_device import get_collective_device
from megatron.core.console import write_line
from megatron.training.checkpointing.errors import CheckpointTrackerError
from megatron.training.checkpointing.layout import TRACKER_FILENAME

_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


def _file_kind(mode):
    for test, kind in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def _not_regular_tracker(path, mode):
    target = f" (a symbolic link to {os.path.realpath(path)})" if os.path.islink(path) else ""
    return CheckpointTrackerError(f"checkpoint tracker file {path}{target} is {_file_kind(mode)}, not a regular file; "
                                  "only a regular file holding the iteration is read: replace it or remove it")


def tracker_exists(path):
    """Whether a tracker file is at ``path``: False when nothing is there, True for a regular file (or a
    symbolic link to one).

    Raises CheckpointTrackerError naming it when something else is there (a FIFO, a device, a
    directory, a broken symbolic link): it is neither read (a FIFO would block the reader for ever)
    nor taken as missing (the run would silently start from scratch).
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            raise CheckpointTrackerError(f"checkpoint tracker file {path} is a broken symbolic link (to "
                                         f"{os.readlink(path)}); replace it or remove it") from None
        return False
    except OSError as exc:
        raise CheckpointTrackerError(f"checkpoint tracker file {path} cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        raise _not_regular_tracker(path, mode)
    return True


def read_tracker(path):
    """``(iteration, release)`` from the tracker file ``path``. Raises FileNotFoundError when it is missing,
    CheckpointTrackerError naming it when it is not a regular file (see :func:`tracker_exists`), cannot be
    read or holds neither a positive integer nor ``release`` (empty, garbage, binary, negative)."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; a regular file reads as usual.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        if os.path.islink(path):
            tracker_exists(path)  # a broken symbolic link: raises naming it
        raise
    except OSError as exc:
        raise CheckpointTrackerError(f"checkpoint tracker file {path} cannot be read ({exc.strerror or exc})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular_tracker(path, mode)
        raw = os.read(fd, 4096)
    except OSError as exc:
        raise CheckpointTrackerError(f"checkpoint tracker file {path} cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise CheckpointTrackerError(f"invalid checkpoint tracker file {path}: expected an iteration number or "
                                     f"'release', found binary data {raw[:16]!r}") from None
    if text == "release":
        return 0, True
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointTrackerError(f"invalid checkpoint tracker file {path}: expected an iteration number or "
                                     f"'release', found {text[:80]!r}") from None
    if iteration <= 0:
        raise CheckpointTrackerError(f"invalid checkpoint tracker file {path}: iteration {iteration} is not positive")
    return iteration, False


def read_tracker_of(directory):
    """``(iteration, release)`` from the tracker of ``directory`` (rank 0's view), or None without one."""
    path = os.path.join(directory, TRACKER_FILENAME)
    if not tracker_exists(path):
        return None
    return read_tracker(path)


def iterations_in(directory):
    """Sorted iterations of the ``iter_NNNNNNN`` directories in ``directory`` (empty when it does not exist)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        match = _ITER_DIR.match(name)
        if match and os.path.isdir(os.path.join(directory, name)):
            found.append(int(match.group(1)))
    return sorted(found)


def read_metadata(tracker_filename):
    """Read a tracker file. Returns ``(iteration, release)``.

    When torch.distributed is initialised the maximum iteration over all ranks is returned
    (a rank reading a stale copy on a non-shared file system prints a warning).
    Raises FileNotFoundError if the file is missing and CheckpointTrackerError
    (a ValueError) naming the file when it holds neither a positive integer nor ``release``.
    """
    iteration, release = read_tracker(tracker_filename)

    if dist.is_initialized():
        iters = torch.tensor([iteration], dtype=torch.long, device=get_collective_device())
        dist.all_reduce(iters, op=dist.ReduceOp.MAX)
        max_iter = int(iters.item())
        if max_iter != iteration:
            write_line(f"WARNING: on rank {dist.get_rank()} found iteration {iteration} in the metadata while max "
                       f"iteration across the ranks is {max_iter}, replacing it with max iteration.")
        iteration = max_iter
    return iteration, release
