"""The integrity manifest of a checkpoint iteration directory: size and CRC-32 of every file, written and verified in parallel over the ranks."""
import errno
import json
import os
import stat
import zlib

from megatron.training.checkpointing.collectives import (
    all_gather_object,
    broadcast_object,
    first_error_everywhere,
    world_rank,
    world_size,
)
from megatron.training.checkpointing.durable import write_text_durably
from megatron.training.checkpointing.errors import CheckpointIntegrityError, NotARegularFileError
from megatron.training.checkpointing.layout import MANIFEST_FILENAME

MANIFEST_VERSION = 1
_CHUNK_BYTES = 8 << 20


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
    for part in all_gather_object(known_digests or {}):
        known.update(part)
    error, entries = None, None
    if world_rank() == 0:
        try:
            entries = _list_files(directory)
        except OSError as exc:
            error = exc
    entries = broadcast_object(None if error is not None else entries)
    if entries is None:
        first_error_everywhere(error or RuntimeError(f"listing {directory} failed on rank 0"))
    todo = [(rel, size) for rel, size in entries if known.get(rel, {}).get("size") != size]
    digests = {}
    try:
        digests = digest_files(directory, _share(todo, world_rank(), world_size()))
    except OSError as exc:
        error = exc
    gathered = all_gather_object(None if error is not None else digests)
    if error is None and any(part is None for part in gathered):
        error = RuntimeError(f"computing the checksums of {directory} failed on another rank")
    if world_rank() == 0 and error is None:
        try:
            files = {rel: known[rel] for rel, _ in entries if rel in known}
            for part in gathered:
                files.update(part)
            manifest = {"version": MANIFEST_VERSION, "algorithm": "crc32", "iteration": iteration,
                        "files": dict(sorted(files.items()))}
            write_text_durably(os.path.join(directory, MANIFEST_FILENAME), json.dumps(manifest, indent=1))
        except OSError as exc:
            error = exc
    first_error_everywhere(error)


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
    if world_rank() == 0:
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
    problems, entries, has_manifest = broadcast_object((problems, entries, has_manifest))
    if full and entries:
        mine = set(_share([(rel, size) for rel, size, _ in entries], world_rank(), world_size()))
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
        for part in all_gather_object(local):
            problems.extend(part)
    return problems, has_manifest
