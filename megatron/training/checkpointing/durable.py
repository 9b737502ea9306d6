"""Durable checkpoint writes (write, fsync, publish by rename) behind one small storage seam that fault tests replace.

Every file operation a save makes durable goes through the :class:`CheckpointStorage` in use
(:func:`get_storage`); :func:`fault_point` marks the named steps of a save (``in_write``,
``before_publish``, ``between_renames``, ``before_tracker``) where a replacement storage may act
(tests/faulty_pretrain.py installs one that crashes, sleeps or reports a full disk there). Production
code installs none: the default storage does the plain operations and nothing at the steps.
"""
import ctypes
import errno
import io
import os
import shutil
import sys

import torch

from megatron.training.arguments import non_directory_ancestor
from megatron.training.checkpointing.errors import CheckpointWriteError
from megatron.training.checkpointing.layout import TRACKER_FILENAME

__all__ = ["CheckpointStorage", "get_storage", "set_storage", "fault_point", "write_failure", "write_durably",
           "fsync_dir", "fsync_tree", "write_text_durably", "write_tracker", "exchange_paths", "replace_dir"]

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2 = None


def _libc_renameat2():
    global _renameat2
    if _renameat2 is None:
        try:
            func = ctypes.CDLL(None, use_errno=True).renameat2
            func.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            func.restype = ctypes.c_int
            _renameat2 = func
        except (AttributeError, OSError):  # not Linux, or a libc before glibc 2.28
            _renameat2 = False
    return _renameat2


class CheckpointStorage:
    """The file operations of a checkpoint save (torchtitan's CheckpointStorage idea): the seam a test replaces.

    Subclasses override a method to inject a fault; :meth:`at` is called at each named step of a save.
    """

    def open_for_write(self, path):
        """Create the parent directories of ``path`` and open it for binary writing."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return open(path, "wb")

    def fsync(self, f):
        """Flush the open file ``f`` to the disk."""
        os.fsync(f.fileno())

    def fsync_dir(self, path):
        """fsync the directory ``path`` (a rename or a new entry is durable only then); errors are ignored."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def rename(self, src, dst):
        """os.rename."""
        os.rename(src, dst)

    def replace(self, src, dst):
        """os.replace (atomically replaces ``dst``)."""
        os.replace(src, dst)

    def exchange(self, a, b):
        """Swap the entries ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``). Returns False where the
        OS, libc or file system cannot (nothing was changed then); raises OSError for other failures."""
        if not sys.platform.startswith("linux"):
            return False
        func = _libc_renameat2()
        if not func:
            return False
        if func(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            return False
        raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a} and {b} failed: {os.strerror(err)}", a)

    def at(self, point, iteration=None):
        """Called at the named step ``point`` of the save of ``iteration``; does nothing here."""


_STORAGE = CheckpointStorage()


def get_storage() -> CheckpointStorage:
    """The storage every durable write goes through."""
    return _STORAGE


def set_storage(storage: CheckpointStorage) -> CheckpointStorage:
    """Install ``storage`` (a CheckpointStorage) for every later save; returns the one it replaces."""
    global _STORAGE
    previous, _STORAGE = _STORAGE, storage
    return previous


def fault_point(point, iteration=None):
    """Mark the step ``point`` of the save of ``iteration`` (see the module docstring)."""
    _STORAGE.at(point, iteration)


class _ErrorRecordingWriter(io.RawIOBase):
    """A file for torch.save that remembers the OSError of a failed write: torch.save reports it only as
    "unexpected pos" (a full disk would otherwise read as an internal error)."""

    def __init__(self, f):
        super().__init__()
        self.f, self.error = f, None

    def writable(self):
        return True

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise


# What a failed write's errno most likely means for a checkpoint save.
_WRITE_FAILURE_HINTS = {errno.ENOSPC: "disk full", errno.EFBIG: "disk full or file-size limit, see ulimit -f",
                        errno.EDQUOT: "disk quota exceeded"}


def write_failure(cause: OSError, path=None) -> CheckpointWriteError:
    """``cause`` (a failed write, open or mkdir) as a CheckpointWriteError naming the file (``path``, else the
    error's own file name) and the cause: ``could not write PATH: File too large (disk full or file-size
    limit, see ulimit -f)``; a directory that cannot be created under a file names that file."""
    if isinstance(cause, CheckpointWriteError):
        return cause
    path = path or cause.filename
    reason = cause.strerror or str(cause)
    if cause.errno in _WRITE_FAILURE_HINTS:
        reason += f" ({_WRITE_FAILURE_HINTS[cause.errno]})"
    if cause.errno in (errno.ENOTDIR, errno.EEXIST) and path is not None:
        blocker = non_directory_ancestor(path)
        if blocker is not None:
            return CheckpointWriteError(f"could not create directory {path}: {blocker} is a file, not a directory",
                                        cause.errno, path)
    message = f"could not write {path}: {reason}" if path is not None else f"could not write: {reason}"
    return CheckpointWriteError(message, cause.errno, path)


def write_durably(state_dict, path):
    """torch.save ``state_dict`` to ``path`` and fsync it; an OSError (e.g. ENOSPC) is raised as a
    CheckpointWriteError naming ``path``."""
    storage = _STORAGE
    try:
        f = storage.open_for_write(path)
    except OSError as exc:
        raise write_failure(exc) from exc
    writer = _ErrorRecordingWriter(f)
    try:
        torch.save(state_dict, writer)
        f.flush()
        storage.fsync(f)
        f.close()
    except Exception as exc:
        try:
            f.close()
        except OSError:
            pass
        cause = exc if isinstance(exc, OSError) else writer.error
        if cause is None:
            raise
        raise write_failure(cause, path) from exc
    storage.fsync_dir(os.path.dirname(path))


def fsync_dir(path):
    """fsync the directory ``path`` (a rename or a new entry is durable only then); errors are ignored."""
    _STORAGE.fsync_dir(path)


def fsync_tree(root):
    """fsync every directory below and including ``root`` (files are fsynced by their writers)."""
    for dirpath, _, _ in os.walk(root, topdown=False):
        fsync_dir(dirpath)


def write_text_durably(path, text):
    """Atomically replace ``path`` with ``text``: write a temporary beside it, fsync, rename, fsync the directory."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            _STORAGE.fsync(f)
        _STORAGE.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(path) or ".")


def write_tracker(directory, text):
    """Atomically replace ``directory/latest_checkpointed_iteration.txt`` with ``text`` (durable on return)."""
    write_text_durably(os.path.join(directory, TRACKER_FILENAME), text)


def exchange_paths(a, b):
    """Swap the entries ``a`` and ``b`` atomically where the file system allows it (see CheckpointStorage.exchange)."""
    return _STORAGE.exchange(a, b)


def replace_dir(src, dst, iteration=None):
    """Move directory ``src`` to ``dst`` so that ``dst``, if it existed, names a complete directory at every
    moment where the file system allows it (swap, then remove the old one); else the old one steps aside
    as ``.NAME.old-<pid>`` until the new one is in place (integrity.recover_leftovers undoes a crash between)."""
    parent, name = os.path.split(dst)
    if os.path.lexists(dst):
        if exchange_paths(src, dst):
            fsync_dir(parent)
            fault_point("between_renames", iteration)
            shutil.rmtree(src, ignore_errors=True)  # now the old directory
            return
        old = os.path.join(parent, f".{name}.old-{os.getpid()}")
        _STORAGE.rename(dst, old)
        fsync_dir(parent)
        fault_point("between_renames", iteration)
        try:
            _STORAGE.rename(src, dst)
        except BaseException:
            _STORAGE.rename(old, dst)  # put the old one back rather than leave dst missing
            raise
        fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    _STORAGE.rename(src, dst)
    fsync_dir(parent)
