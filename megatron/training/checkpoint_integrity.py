"""Crash safety and integrity of checkpoint iteration directories, whatever format wrote their files.

A save writes its files into a hidden temporary directory ``<dir>/.iter_NNNNNNN.tmp-<pid>``; then
:func:`publish_iteration` (called by every rank once every rank has written and fsynced its files):

1. writes ``integrity_manifest.json`` into it: the size and CRC-32 of every file, computed in parallel
   (the files are split among the ranks, rank 0 gathers the digests and writes the manifest durably);
2. fsyncs every directory of the tree, then moves it to ``iter_NNNNNNN`` atomically. An existing
   ``iter_NNNNNNN`` (a re-save of the iteration the tracker names) is swapped with the new one in one
   ``renameat2(RENAME_EXCHANGE)`` call, so the tracker never names a missing directory. Where the file
   system or libc lacks it, the old directory steps aside as ``.iter_NNNNNNN.old-<pid>`` and is removed
   only once the new one is in place; :func:`recover_leftovers` (at the next save) and
   :func:`choose_checkpoint` (at load) move it back if a crash came in between;
3. replaces ``latest_checkpointed_iteration.txt`` atomically (write a temporary, fsync, rename, fsync dir).

At load, :func:`choose_checkpoint` checks the iteration named by the tracker against its manifest (file
presence and sizes always; CRC-32 unless ``--no-verify-checkpoint``; an entry must name a regular file
inside the iteration directory, :func:`manifest_entry_path`, so a manifest can neither make a loader read
outside the checkpoint nor block it on a FIFO or device) and falls back to the newest
complete older one with a warning naming both; ``--ckpt-step N`` on a damaged iteration raises
:class:`CheckpointIntegrityError` naming the file. It also compares with the newest non-persistent
checkpoint (``--non-persistent-save-interval``) and picks the newer.

Test-only hooks (environment variables read at each save; never set them in production):

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
    use the fallback of step 2 even where ``renameat2(RENAME_EXCHANGE)`` works.
"""
import ctypes
import errno
import json
import os
import re
import shutil
import signal
import stat
import sys
import time
import zlib

import torch.distributed as dist

from megatron.core.console import write_line

MANIFEST_FILENAME = "integrity_manifest.json"
MANIFEST_VERSION = 1
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
NON_PERSISTENT_SUBDIR = "non_persistent"  # Megatron-LM's _NON_PERSISTENT_CKPT_SUBDIR
_CHUNK_BYTES = 8 << 20
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
_LEFTOVER = re.compile(r"^\.(iter_\d{7,}|release)\.(tmp|old)-\d+$")


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint iteration directory that is missing, incomplete or whose files do not match its manifest."""


# ---------------------------------------------------------------------------------------------------
# Collectives (no-ops in a single process)
# ---------------------------------------------------------------------------------------------------

def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def _broadcast_object(obj):
    """Rank 0's ``obj`` on every rank."""
    if not dist.is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _all_gather_object(obj):
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


class FailedOnAnotherRankError(RuntimeError):
    """A checkpoint step that failed on another rank (this rank's message names it; that rank reports its own)."""


def _first_error_everywhere(error):
    """Raise on every rank if any rank has ``error``: the rank's own error, else a FailedOnAnotherRankError
    naming the other rank."""
    reports = _all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    for rank, report in enumerate(reports):
        if report is not None:
            raise FailedOnAnotherRankError(f"checkpoint step failed on rank {rank}: {report}")


# ---------------------------------------------------------------------------------------------------
# Digests and manifest
# ---------------------------------------------------------------------------------------------------

class NotARegularFileError(OSError):
    """A path that names something else than a regular file (a FIFO, device, directory, socket)."""


def _kind(mode):
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def file_digest(path):
    """``(size in bytes, CRC-32 as 8 lower-case hex digits)`` of the regular file ``path``, read in 8 MiB chunks.

    Raises NotARegularFileError (an OSError) for anything else: it is opened without blocking and checked
    after the open, so a FIFO or a device (``/dev/zero`` never ends) is refused before any read.
    """
    crc, size = 0, 0
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFileError(errno.EINVAL, f"not a regular file ({_kind(mode)})", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        while True:
            chunk = f.read(_CHUNK_BYTES)
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, f"{crc & 0xFFFFFFFF:08x}"


def manifest_entry_path(directory, rel):
    """The path of the manifest entry ``rel`` of the iteration directory ``directory``, or a reason (a string)
    why it may not be read: an entry must be a relative path without ``..`` that stays inside
    ``directory`` once links are resolved, and must name a regular file. Returns ``(path, None)`` or
    ``(None, reason)``; the reason names the entry, never anything read from the file it names."""
    shown = f"{MANIFEST_FILENAME} of {directory} lists {rel[:200]!r}"
    if not rel or "\0" in rel or "\\" in rel or os.path.isabs(rel) or \
            any(part in ("..", "") for part in rel.split("/")):
        return None, f"{shown}, which is not a relative path inside the checkpoint directory"
    path = os.path.join(directory, rel)
    root = os.path.realpath(directory)
    real = os.path.realpath(path)
    if os.path.commonpath([root, real]) != root or real == root:
        return None, f"{shown}, which leads to {real}, outside the checkpoint directory"
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return path, None  # reported as missing by the caller
    if not stat.S_ISREG(mode):
        return None, f"{shown}, which is {_kind(mode)}, not a regular file"
    return path, None


def _list_files(root):
    """Sorted ``[(relative path, size)]`` of the regular files under ``root``, the manifest excluded."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if rel == MANIFEST_FILENAME:
                continue
            found.append((rel.replace(os.sep, "/"), os.path.getsize(path)))
    return sorted(found)


def _share(entries, rank, world_size):
    """The entries ``rank`` handles: greedy by size (largest first, to the least loaded rank), deterministic."""
    loads = [0] * world_size
    mine = []
    for index, (rel, size) in sorted(enumerate(entries), key=lambda item: (-item[1][1], item[0])):
        target = min(range(world_size), key=lambda r: (loads[r], r))
        loads[target] += max(size, 1)
        if target == rank:
            mine.append(rel)
    return mine


def digest_files(root, rel_paths):
    """``{relative path: {"size", "crc32"}}`` of the files ``rel_paths`` under ``root``: for a writer that
    digests the files it wrote off the training thread (an ``--async-save`` background writer) and hands
    the result to :func:`publish_iteration` as ``known_digests``."""
    digests = {}
    for rel in rel_paths:
        size, crc = file_digest(os.path.join(root, rel))
        digests[rel.replace(os.sep, "/")] = {"size": size, "crc32": crc}
    return digests


def write_manifest(directory, iteration=None, known_digests=None):
    """Write ``directory/integrity_manifest.json`` (size and CRC-32 of every file below it); all ranks call it.

    ``known_digests`` (this rank's :func:`digest_files` of files it wrote, or None) are used for files whose
    size still matches; rank 0 lists the files and the others are digested now, split among the ranks by
    size. Rank 0 writes the manifest through a temporary file and fsyncs it and its directory. Raises on
    every rank when any rank fails.
    """
    known = {}
    for part in _all_gather_object(known_digests or {}):
        known.update(part)
    error, entries = None, None
    if _rank() == 0:
        try:
            entries = _list_files(directory)
        except OSError as exc:
            error = exc
    entries = _broadcast_object(None if error is not None else entries)
    if entries is None:
        _first_error_everywhere(error or RuntimeError(f"listing {directory} failed on rank 0"))
    todo = [(rel, size) for rel, size in entries if known.get(rel, {}).get("size") != size]
    digests = {}
    try:
        digests = digest_files(directory, _share(todo, _rank(), _world_size()))
    except OSError as exc:
        error = exc
    gathered = _all_gather_object(None if error is not None else digests)
    if error is None and any(part is None for part in gathered):
        error = RuntimeError(f"computing the checksums of {directory} failed on another rank")
    if _rank() == 0 and error is None:
        try:
            files = {rel: known[rel] for rel, _ in entries if rel in known}
            for part in gathered:
                files.update(part)
            manifest = {"version": MANIFEST_VERSION, "algorithm": "crc32", "iteration": iteration,
                        "files": dict(sorted(files.items()))}
            _write_text_durably(os.path.join(directory, MANIFEST_FILENAME), json.dumps(manifest, indent=1))
        except OSError as exc:
            error = exc
    _first_error_everywhere(error)


def read_manifest(directory):
    """The manifest dict of ``directory``, or None when it has none. Raises CheckpointIntegrityError
    naming the manifest when it is unreadable or malformed."""
    path = os.path.join(directory, MANIFEST_FILENAME)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointIntegrityError(f"checkpoint manifest {path} cannot be read ({exc})") from exc
    try:  # a FIFO or a device (a link to /dev/zero) would block or never end
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointIntegrityError(f"checkpoint manifest {path} is {_kind(info.st_mode)}, not a regular file")
        os.set_blocking(fd, True)
        with os.fdopen(os.dup(fd), "rb") as f:
            text = f.read(info.st_size)
    except OSError as exc:
        raise CheckpointIntegrityError(f"checkpoint manifest {path} cannot be read ({exc})") from exc
    finally:
        os.close(fd)
    try:
        manifest = json.loads(text.decode("utf-8"))
        files = manifest["files"]
        if not isinstance(files, dict) or not all(
                isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("crc32"), str)
                for v in files.values()):
            raise ValueError("'files' is not a mapping of {size, crc32}")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointIntegrityError(f"checkpoint manifest {path} is corrupt ({exc})") from None
    return manifest


def verify_directory(directory, full=True):
    """Problems of checkpoint directory ``directory`` against its manifest; all ranks call it, same answer.

    Returns ``(problems, has_manifest)``: ``problems`` is a list of strings, each naming a file (empty
    when every file listed in the manifest is present with its size and, when ``full``, its CRC-32);
    ``has_manifest`` is False for directories written without one (older versions, other tools), which
    are not checked. The CRC-32 reads are split among the ranks.
    """
    problems, entries, has_manifest = [], [], True
    if _rank() == 0:
        if not os.path.isdir(directory):
            problems.append(f"{directory} does not exist")
        else:
            try:
                manifest = read_manifest(directory)
            except CheckpointIntegrityError as exc:
                problems.append(str(exc))
                manifest = {"files": {}}
            if manifest is None:
                has_manifest = False
            else:
                for rel, info in manifest["files"].items():
                    path, refused = manifest_entry_path(directory, rel)
                    if refused is not None:
                        problems.append(refused)
                        continue
                    try:
                        size = os.path.getsize(path)
                    except OSError:
                        problems.append(f"{path} is missing (listed in {MANIFEST_FILENAME})")
                        continue
                    if size != info["size"]:
                        problems.append(f"{path} is truncated or damaged: {size} bytes, {MANIFEST_FILENAME} "
                                        f"says {info['size']}")
                    else:
                        entries.append((rel, size, info["crc32"]))
    problems, entries, has_manifest = _broadcast_object((problems, entries, has_manifest))
    if full and entries:
        mine = set(_share([(rel, size) for rel, size, _ in entries], _rank(), _world_size()))
        local = []
        for rel, _, expected in entries:
            if rel not in mine:
                continue
            path = os.path.join(directory, rel)
            try:
                _, crc = file_digest(path)
            except OSError as exc:
                local.append(f"{path} cannot be read ({exc})")
                continue
            if crc != expected:
                local.append(f"{path} is corrupt: CRC-32 {crc}, {MANIFEST_FILENAME} says {expected}")
        for part in _all_gather_object(local):
            problems.extend(part)
    return problems, has_manifest


# ---------------------------------------------------------------------------------------------------
# Durable file-system steps
# ---------------------------------------------------------------------------------------------------

def fsync_dir(path):
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


def fsync_tree(root):
    """fsync every directory below and including ``root`` (files are fsynced by their writers)."""
    for dirpath, _, _ in os.walk(root, topdown=False):
        fsync_dir(dirpath)


def _write_text_durably(path, text):
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(path) or ".")


def write_tracker(directory, text):
    """Atomically replace ``directory/latest_checkpointed_iteration.txt`` with ``text`` (durable on return)."""
    _write_text_durably(os.path.join(directory, TRACKER_FILENAME), text)


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


def exchange_paths(a, b):
    """Swap the entries ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``). Returns False where the
    OS, libc or file system cannot (nothing was changed then); raises OSError for other failures."""
    if os.environ.get("MEGATRON_TEST_NO_RENAME_EXCHANGE") == "1" or not sys.platform.startswith("linux"):
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


def replace_dir(src, dst, iteration=None):
    """Move directory ``src`` to ``dst`` so that ``dst``, if it existed, names a complete directory at every
    moment where the file system allows it (swap, then remove the old one); else the old one steps aside
    as ``.NAME.old-<pid>`` until the new one is in place (:func:`recover_leftovers` undoes a crash between)."""
    parent, name = os.path.split(dst)
    if os.path.lexists(dst):
        if exchange_paths(src, dst):
            fsync_dir(parent)
            test_hook("between_renames", iteration)
            shutil.rmtree(src, ignore_errors=True)  # now the old directory
            return
        old = os.path.join(parent, f".{name}.old-{os.getpid()}")
        os.rename(dst, old)
        fsync_dir(parent)
        test_hook("between_renames", iteration)
        try:
            os.rename(src, dst)
        except BaseException:
            os.rename(old, dst)  # put the old one back rather than leave dst missing
            raise
        fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    os.rename(src, dst)
    fsync_dir(parent)


def recover_leftovers(directory, remove_temporaries=True):
    """Repair what a crashed save left in ``directory``; rank 0 only. Returns the actions (strings) taken.

    ``.iter_N.old-<pid>`` (a complete directory moved aside by the rename fallback): moved back to
    ``iter_N`` when that is missing, removed otherwise. ``.iter_N.tmp-<pid>`` (an unpublished or, after a
    swap, a replaced directory) and tracker temporaries: removed when ``remove_temporaries`` (at save; a
    load leaves them, they may belong to a save in progress).
    """
    actions = []
    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return actions
    for entry in entries:
        match = _LEFTOVER.match(entry)
        path = os.path.join(directory, entry)
        if match is None:
            if remove_temporaries and entry.startswith(f".{TRACKER_FILENAME}.tmp-"):
                _remove(path)
            continue
        final = os.path.join(directory, match.group(1))
        if match.group(2) == "old":
            if not os.path.lexists(final):
                try:
                    os.rename(path, final)
                    fsync_dir(directory)
                    actions.append(f"restored {final} from {path} (left by a save that crashed while replacing it)")
                except OSError as exc:
                    actions.append(f"could not restore {final} from {path}: {exc}")
            elif remove_temporaries:
                _remove(path)
                actions.append(f"removed {path} (left by a save that crashed after replacing {final})")
        elif remove_temporaries:
            _remove(path)
            actions.append(f"removed {path} (left by a save that did not finish)")
    return actions


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.remove(path)
        except OSError:
            pass


def iteration_dirname(iteration, release=False):
    return "release" if release else "iter_{:07d}".format(iteration)


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


# ---------------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------------

def prepare_save_dir(save_dir):
    """Rank 0 before a save: create ``save_dir`` and repair leftovers of crashed saves (printed)."""
    os.makedirs(save_dir, exist_ok=True)
    for action in recover_leftovers(save_dir):
        write_line(f"WARNING: checkpoint directory {save_dir}: {action}")


def publish_iteration(save_dir, tmp_dir, iteration, release=False, keep_only_newest=False, retain_interval=None,
                      known_digests=None):
    """Make the fully written ``tmp_dir`` the checkpoint of ``iteration`` in ``save_dir``; all ranks call it
    after every rank has written and fsynced its files.

    Writes the manifest, fsyncs the tree, moves it to ``iter_NNNNNNN`` (:func:`replace_dir`), then replaces
    the tracker. ``keep_only_newest`` (non-persistent checkpoints) then removes every other ``iter_*``;
    ``retain_interval`` (``--save-retain-interval``) removes older ones whose iteration is not a multiple.
    ``known_digests``: see :func:`write_manifest`.
    Raises on every rank when any step fails; the previous checkpoint and tracker are then unchanged.
    """
    test_hook("before_publish", iteration)
    write_manifest(tmp_dir, iteration, known_digests)
    error = None
    if _rank() == 0:
        final_dir = os.path.join(save_dir, iteration_dirname(iteration, release))
        try:
            fsync_tree(tmp_dir)
            replace_dir(tmp_dir, final_dir, iteration)
            test_hook("before_tracker", iteration)
            write_tracker(save_dir, "release" if release else str(iteration))
            for old in iterations_in(save_dir):
                if old == iteration:
                    continue
                if keep_only_newest or (retain_interval and old < iteration and old % retain_interval != 0):
                    shutil.rmtree(os.path.join(save_dir, iteration_dirname(old)), ignore_errors=True)
        except Exception as exc:  # reported to every rank
            error = exc
    _first_error_everywhere(error)


# ---------------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------------

def _describe_problems(problems, limit=5):
    shown = "; ".join(problems[:limit])
    return shown + (f"; and {len(problems) - limit} more" if len(problems) > limit else "")


class CheckpointTrackerError(ValueError):
    """A ``latest_checkpointed_iteration.txt`` that holds neither a positive iteration nor ``release``."""


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


def _read_tracker(directory):
    """``(iteration, release)`` from the tracker of ``directory`` (rank 0's view), or None without one."""
    path = os.path.join(directory, TRACKER_FILENAME)
    if not tracker_exists(path):
        return None
    return read_tracker(path)


def _newest_complete(directory, start_iteration, release, verify, label, warn):
    """The newest complete checkpoint of ``directory`` at or below ``start_iteration`` (the tracker's):
    ``(iteration, release)`` or None when none is complete, then with the reason. All ranks call it."""
    if release:
        problems, _ = verify_directory(os.path.join(directory, "release"), full=verify)
        return ((0, True), None) if not problems else (None, _describe_problems(problems))
    candidates = _broadcast_object([it for it in iterations_in(directory) if it < start_iteration]
                                   if _rank() == 0 else None)
    skipped = []  # (iteration, problems) of the damaged ones, newest first
    for iteration in [start_iteration] + sorted(candidates, reverse=True):
        path = os.path.join(directory, iteration_dirname(iteration))
        problems, has_manifest = verify_directory(path, full=verify)
        if not problems:
            if skipped:
                damaged = "; ".join(f"iteration {it} ({os.path.join(directory, iteration_dirname(it))}) is "
                                    f"incomplete or corrupt ({text})" for it, text in skipped)
                warn(f"WARNING: {label}: {damaged}; loading iteration {iteration} ({path}), the newest complete "
                     "one, instead")
            if not has_manifest:
                warn(f"WARNING: {label}: {path} has no {MANIFEST_FILENAME} (written by another tool or version); "
                     "its files are not verified")
            return (iteration, False), None
        skipped.append((iteration, _describe_problems(problems)))
    return None, skipped[0][1]


def choose_checkpoint(load_dir, ckpt_step=None, verify=True, non_persistent_dir=None, flag="--load", warn=None):
    """Which checkpoint to load; all ranks call it and get the same answer.

    Args:
        load_dir: the persistent checkpoint directory (``--load``); may be None with ``non_persistent_dir``.
        ckpt_step: ``--ckpt-step``: exactly this iteration of ``load_dir``, refused when damaged.
        verify: check CRC-32s (False: ``--no-verify-checkpoint``, presence and sizes only).
        non_persistent_dir: the directory of non-persistent checkpoints, or None; its newest complete
            checkpoint wins when it is newer than (or as new as) the persistent one.
        flag: how ``load_dir`` is named in messages.
        warn: ``f(message)`` for warnings (default: print on rank 0).
    Returns ``(directory, iteration, release)``, or None when neither directory has a tracker.
    Raises CheckpointIntegrityError naming the damaged file(s) when the requested or every candidate
    iteration is damaged; ValueError for a malformed tracker.
    """
    if warn is None:
        def warn(message):
            if _rank() == 0:
                write_line(message)

    if ckpt_step is not None:
        directory = os.path.join(load_dir, iteration_dirname(ckpt_step))
        problems, has_manifest = verify_directory(directory, full=verify)
        if problems:
            raise CheckpointIntegrityError(f"--ckpt-step {ckpt_step}: checkpoint {directory} of {flag} {load_dir} "
                                           f"cannot be loaded: {_describe_problems(problems)}")
        if not has_manifest:
            warn(f"WARNING: {directory} has no {MANIFEST_FILENAME} (written by another tool or version); "
                 "its files are not verified")
        return load_dir, ckpt_step, False

    candidates = []  # (tracker iteration, is non-persistent, directory, label, release)
    for directory, label, is_np in ((load_dir, f"{flag} {load_dir}", False),
                                    (non_persistent_dir, f"non-persistent checkpoints {non_persistent_dir}", True)):
        if directory is None:
            continue
        tracker, error = None, None
        if _rank() == 0:
            for action in recover_leftovers(directory, remove_temporaries=False):
                warn(f"WARNING: {label}: {action}")
            try:
                tracker = _read_tracker(directory)
            except (ValueError, OSError) as exc:
                error = exc
        _first_error_everywhere(error)
        tracker = _broadcast_object(tracker)
        if tracker is not None:
            candidates.append((tracker[0], is_np, directory, label, tracker[1]))
    if not candidates:
        return None
    # The directory whose tracker is newest first (the non-persistent one on a tie, as in Megatron-LM);
    # the other is verified only if it could still hold a newer complete checkpoint.
    candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
    best, failures = None, []
    for tracker_iteration, is_np, directory, label, release in candidates:
        if best is not None and best[1] >= tracker_iteration:
            break
        found, problem = _newest_complete(directory, tracker_iteration, release, verify, label, warn)
        if found is None:
            failures.append(f"{label}: the newest, iteration {tracker_iteration} "
                            f"({os.path.join(directory, iteration_dirname(tracker_iteration, release))}, named by "
                            f"{TRACKER_FILENAME}), is incomplete or corrupt ({problem}) and no older one is complete")
            continue
        if best is None or found[0] > best[1]:
            best = (directory, found[0], found[1], label, is_np)
    if best is None:
        raise CheckpointIntegrityError("no complete checkpoint to load: " + "; ".join(failures))
    directory, iteration, release, label, is_np = best
    for failure in failures:
        warn(f"WARNING: {failure}; loading iteration {iteration} of {label} instead")
    if is_np:
        warn(f"loading non-persistent checkpoint of iteration {iteration} from {directory}")
    return directory, iteration, release


# ---------------------------------------------------------------------------------------------------
# Test hooks (see the module docstring)
# ---------------------------------------------------------------------------------------------------

def test_hook(point, iteration=None):
    """Act on the MEGATRON_TEST_* variables at ``point`` of a save (``in_write``, ``before_publish``,
    ``between_renames``, ``before_tracker``). Does nothing unless one is set; test use only."""
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
    if wanted_rank is not None and int(wanted_rank) != _rank():
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
            f.write(f"{point} rank {_rank()} pid {os.getpid()}\n")
