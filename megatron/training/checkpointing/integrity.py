"""Crash safety and integrity of checkpoint iteration directories, whatever format wrote their files.

A save writes its files into a hidden temporary directory ``<dir>/.iter_NNNNNNN.tmp-<pid>``; then
:func:`publish_iteration` (called by every rank once every rank has written and fsynced its files):

1. writes ``integrity_manifest.json`` into it: the size and CRC-32 of every file, computed in parallel
   (manifest.py: the files are split among the ranks, rank 0 gathers the digests and writes the manifest
   durably);
2. fsyncs every directory of the tree, then moves it to ``iter_NNNNNNN`` atomically (durable.replace_dir). An
   existing ``iter_NNNNNNN`` (a re-save of the iteration the tracker names) is swapped with the new one in one
   ``renameat2(RENAME_EXCHANGE)`` call, so the tracker never names a missing directory. Where the file
   system or libc lacks it, the old directory steps aside as ``.iter_NNNNNNN.old-<pid>`` and is removed
   only once the new one is in place; :func:`recover_leftovers` (at the next save) and
   :func:`choose_checkpoint` (at load) move it back if a crash came in between;
3. replaces ``latest_checkpointed_iteration.txt`` atomically (write a temporary, fsync, rename, fsync dir).

At load, :func:`choose_checkpoint` checks the iteration named by the tracker against its manifest (file
presence and sizes always; CRC-32 unless ``--no-verify-checkpoint``; an entry must name a regular file
inside the iteration directory, manifest.manifest_entry_path, so a manifest can neither make a loader read
outside the checkpoint nor block it on a FIFO or device) and falls back to the newest
complete older one with a warning naming both; ``--ckpt-step N`` on a damaged iteration raises
:class:`CheckpointIntegrityError` naming the file. It also compares with the newest non-persistent
checkpoint (``--non-persistent-save-interval``) and picks the newer.

The fault drills act at the named steps of a save through durable.py's storage seam (tests/faulty_pretrain.py).
"""
import os
import re
import shutil

from megatron.core.console import write_line
from megatron.training.checkpointing.collectives import broadcast_object, first_error_everywhere, world_rank
from megatron.training.checkpointing.durable import fault_point, fsync_dir, fsync_tree, replace_dir, write_tracker
from megatron.training.checkpointing.errors import CheckpointIntegrityError
from megatron.training.checkpointing.layout import MANIFEST_FILENAME, TRACKER_FILENAME, iteration_dirname
from megatron.training.checkpointing.manifest import verify_directory, write_manifest
from megatron.training.checkpointing.tracker import iterations_in, read_tracker_of

_LEFTOVER = re.compile(r"^\.(iter_\d{7,}|release)\.(tmp|old)-\d+$")


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
    fault_point("before_publish", iteration)
    write_manifest(tmp_dir, iteration, known_digests)
    error = None
    if world_rank() == 0:
        final_dir = os.path.join(save_dir, iteration_dirname(iteration, release))
        try:
            fsync_tree(tmp_dir)
            replace_dir(tmp_dir, final_dir, iteration)
            fault_point("before_tracker", iteration)
            write_tracker(save_dir, "release" if release else str(iteration))
            for old in iterations_in(save_dir):
                if old == iteration:
                    continue
                if keep_only_newest or (retain_interval and old < iteration and old % retain_interval != 0):
                    shutil.rmtree(os.path.join(save_dir, iteration_dirname(old)), ignore_errors=True)
        except Exception as exc:  # reported to every rank
            error = exc
    first_error_everywhere(error)

# ---------------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------------


def _describe_problems(problems, limit=5):
    shown = "; ".join(problems[:limit])
    return shown + (f"; and {len(problems) - limit} more" if len(problems) > limit else "")


def _newest_complete(directory, start_iteration, release, verify, label, warn):
    """The newest complete checkpoint of ``directory`` at or below ``start_iteration`` (the tracker's):
    ``(iteration, release)`` or None when none is complete, then with the reason. All ranks call it."""
    if release:
        problems, _ = verify_directory(os.path.join(directory, "release"), full=verify)
        return ((0, True), None) if not problems else (None, _describe_problems(problems))
    candidates = broadcast_object([it for it in iterations_in(directory) if it < start_iteration]
                                   if world_rank() == 0 else None)
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
            if world_rank() == 0:
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
        if world_rank() == 0:
            for action in recover_leftovers(directory, remove_temporaries=False):
                warn(f"WARNING: {label}: {action}")
            try:
                tracker = read_tracker_of(directory)
            except (ValueError, OSError) as exc:
                error = exc
        first_error_everywhere(error)
        tracker = broadcast_object(tracker)
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
