"""Save and load lists of :class:`ShardedTensor` with torch.distributed.checkpoint (DCP).

Every rank writes its own chunks (``__<rank>_0.distcp`` files) in parallel; chunks that several
ranks hold (replicated tensors: layer norms, data-parallel replicas) are written once, by the
rank DCP's de-duplication picks. The coordinator writes ``.metadata``: every key's global shape,
dtype and the chunks stored. Loading intersects each requested chunk with the stored ones, so any
parallel layout can read a checkpoint written by any other. Every read goes through
``safe_loading`` (``.metadata`` by an allow-list unpickler, pickled items weights-only), never
through torch's plain ``pickle.load``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed._shard._utils import narrow_tensor_by_index

from megatron.core.collective_device import get_collective_device
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.safe_loading import (
    SafeFileSystemReader, check_data_files, check_inside, read_dcp_metadata, weights_only_load,
)
from megatron.core.dist_checkpointing.validation import StrictHandling, parse_strict_flag

logger = logging.getLogger(__name__)

METADATA_FILENAME = ".metadata"
# Megatron core_v0.14's description of a torch_dist checkpoint, which its loader reads first.
MEGATRON_METADATA_FILENAME = "metadata.json"
MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                     "common_backend_version": 1}


class CheckpointMismatchError(CheckpointingException, ValueError):
    """The checkpoint does not hold what the model/optimizer needs (missing keys, other shapes)."""


def _index(sharded: Sequence[ShardedTensor], for_save: bool = False) -> Dict[Tuple[str, Tuple[int, ...]],
                                                                               ShardedTensor]:
    out = {}
    for item in sharded:
        if isinstance(item, ShardedObject) or item.data.numel() == 0 or (for_save and item.replica):
            continue
        slot = (item.key, item.global_offset)
        if slot in out:
            raise ValueError(f"sharded tensor {item.key} at offset {item.global_offset} given twice on one rank")
        out[slot] = item
    return out


class ShardedSavePlanner(DefaultSavePlanner):
    """Writes the given sharded tensors at their global offsets; DCP's global step de-duplicates replicas."""

    def __init__(self, sharded: Sequence):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items = _index(sharded, for_save=True)
        self._objects = {item.key: item for item in sharded if isinstance(item, ShardedObject) and not item.replica}
        # Megatron's loader looks up the parameter shape of every flattened tensor in metadata.mcore_data.
        self._mcore_data = {}
        for item in sharded:
            if isinstance(item, ShardedTensor):
                self._mcore_data.setdefault(item.key, {} if item.orig_global_shape is None else
                                            {"nd_reformulated_orig_global_shape": tuple(item.orig_global_shape)})

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for (key, offset), item in self._items.items():
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size(offset)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offset), sizes=item.data.size()),
                    properties=TensorProperties.create_from_tensor(item.data),
                    size=torch.Size(item.global_shape),
                ),
            ))
        for key in self._objects:
            items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items, planner_data=self._mcore_data)
        return self.plan

    def create_global_plan(self, all_plans: List[SavePlan]):
        global_plan, metadata = super().create_global_plan(all_plans)
        mcore_data = {}
        for plan in all_plans:
            mcore_data.update(plan.planner_data or {})
        global_plan = [dataclasses.replace(plan, planner_data=None) for plan in global_plan]
        metadata = dataclasses.replace(metadata, planner_data=None)
        metadata.mcore_data = mcore_data
        self.metadata = metadata
        return global_plan, metadata

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._objects[write_item.index.fqn].data)
        return self._items[(write_item.index.fqn, tuple(write_item.index.offset))].data.detach()


class ShardedLoadPlanner(LoadPlanner):
    """Reads every requested chunk in place into its ``data`` view (see :func:`load`); pickled object items
    (DCP BytesStorage) go to ``objects`` (``{key: object}``), loaded weights-only with ``safe_globals``
    (e.g. numpy's RNG-state types) allowed besides torch's defaults."""

    def __init__(self, targets: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor],
                 chunks: List[Tuple[str, ChunkStorageMetadata]], safe_globals: Sequence = ()):
        self._targets = targets
        self._chunks = chunks
        self._safe_globals = list(safe_globals)
        self.objects: Dict[str, object] = {}

    def set_up_planner(self, state_dict, metadata: Optional[Metadata] = None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        requests: List[ReadItem] = []
        for key, chunk in self._chunks:
            requests.extend(create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk]))
        return LoadPlan(requests)

    def create_global_plan(self, global_plan: List[LoadPlan]) -> List[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value) -> None:
        # torch's DefaultLoadPlanner unpickles these with weights_only=False; never here.
        fqn = read_item.dest_index.fqn
        self.objects[fqn] = weights_only_load(value, f"checkpoint item {fqn}", self._safe_globals)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self._targets[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        return narrow_tensor_by_index(target, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # read in place into the view returned by resolve_tensor


class _WriteErrorRecorder:
    """A stream of DCP's writer that remembers the OSError of a failed write and the file it was writing:
    torch.save reports such a failure only as "unexpected pos", without the file or the cause (a full disk,
    a file-size limit). Everything but ``write``/``flush``/``close`` is the stream's own."""

    def __init__(self, stream, path, errors: list):
        self._stream, self._path, self._errors = stream, path, errors

    def _recorded(self, method, *args):
        try:
            return getattr(self._stream, method)(*args)
        except OSError as exc:
            self._errors.append((os.fspath(self._path), exc))
            raise

    def write(self, data):
        return self._recorded("write", data)

    def flush(self):
        return self._recorded("flush")

    def close(self):
        return self._recorded("close")

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _ErrorNamingFileSystem(FileSystem):
    """DCP's local file system whose write streams record their OSErrors (see :class:`_WriteErrorRecorder`)."""

    def __init__(self, errors: list):
        super().__init__()
        self._errors = errors

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            yield _WriteErrorRecorder(stream, path, self._errors) if "w" in mode or "a" in mode else stream


class _ErrorNamingWriter(dcp.FileSystemWriter):
    """DCP's FileSystemWriter whose failed data or ``.metadata`` write raises an OSError naming the file
    and the cause (errno and strerror of the failed write) instead of torch.save's "unexpected pos"."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._errors: list = []
        self.fs = _ErrorNamingFileSystem(self._errors)

    def _named(self, exc: Exception) -> Exception:
        if not self._errors:
            return exc
        path, cause = self._errors[0]
        return OSError(cause.errno, cause.strerror or str(cause), path)

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception as exc:
            raise self._named(exc) from exc

    def finish(self, metadata, results):
        try:
            return super().finish(metadata, results)
        except Exception as exc:
            raise self._named(exc) from exc


def save(sharded: Sequence, checkpoint_dir: str, process_group=None, thread_count: int = 1) -> None:
    """Write ``sharded`` (this rank's :class:`ShardedTensor` chunks and :class:`ShardedObject` entries)
    into ``checkpoint_dir``; every rank of ``process_group`` calls it. The coordinator also writes
    Megatron's ``metadata.json``.

    Raises on every rank when a write fails on any: the failing rank its own error (an OSError naming
    the file for a failed write: a full disk, a file-size limit), the others a
    SaveFailedOnAnotherRankError (a RuntimeError) naming the failing rank and its error, instead of
    DCP's CheckpointException (a BaseException carrying every rank's traceback).
    """
    planner = ShardedSavePlanner(sharded)
    writer = _ErrorNamingWriter(checkpoint_dir, thread_count=thread_count, sync_files=True, overwrite=True)
    try:
        dcp.save({}, storage_writer=writer, planner=planner, process_group=process_group)
    except CheckpointException as exc:
        raise _save_failure(exc, process_group) from None
    if not dist.is_initialized() or dist.get_rank(process_group) == 0:
        write_megatron_metadata(checkpoint_dir)


def _save_failure(exc: CheckpointException, process_group=None) -> Exception:
    """This rank's own error out of DCP's gathered save failures, else a RuntimeError naming the first failing rank."""
    rank = dist.get_rank(process_group) if dist.is_initialized() else 0
    failures = exc.failures
    if rank in failures and isinstance(failures[rank][0], Exception):
        return failures[rank][0]
    first = rank if rank in failures else min(failures)
    error = failures[first][0]
    summary = (str(error).splitlines() or [""])[0][:300]
    return SaveFailedOnAnotherRankError(f"writing the checkpoint failed on rank {first} "
                                        f"({type(error).__name__}: {summary})")


class SaveFailedOnAnotherRankError(CheckpointingException, RuntimeError):
    """A :func:`save` that failed on another rank of its process group (the message names it and its error;
    that rank raises its own)."""


def write_megatron_metadata(checkpoint_dir: str) -> None:
    """Write ``metadata.json`` (Megatron core_v0.14's backend description) into ``checkpoint_dir``, fsynced."""
    name = os.path.join(checkpoint_dir, MEGATRON_METADATA_FILENAME)
    try:
        with open(name, "w") as f:
            json.dump(MEGATRON_METADATA, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:  # a failed write names no file
        raise OSError(exc.errno, exc.strerror or str(exc), name) from exc


def read_metadata(checkpoint_dir: str) -> Metadata:
    """DCP's ``.metadata`` of ``checkpoint_dir`` (global shapes, dtypes and stored chunks of every key), read
    by the allow-list unpickler of :mod:`safe_loading` (torch's reader would run any code it holds).

    ``.metadata`` must not be a link out of ``checkpoint_dir``. Its entries are checked
    (safe_loading.check_metadata: chunks that tile each tensor, no transforms) and
    so are its data files (safe_loading.check_data_files: regular files inside ``checkpoint_dir``, items
    inside them and as large as the chunks they hold), before anything is allocated.

    Raises FileNotFoundError, safe_loading.UnsafeCheckpointError / CheckpointFileError naming the file.
    """
    check_inside(checkpoint_dir, METADATA_FILENAME)
    metadata = read_dcp_metadata(os.path.join(checkpoint_dir, METADATA_FILENAME))
    check_data_files(metadata, checkpoint_dir)
    return metadata


def load(sharded: Sequence[ShardedTensor], checkpoint_dir: str, metadata: Optional[Metadata] = None,
         allow_missing: Callable[[str], bool] = lambda key: False, process_group=None,
         strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
         unread_ok: Callable[[str], bool] = lambda key: False) -> List[str]:
    """Read this rank's chunks of ``checkpoint_dir`` into the ``data`` views of ``sharded``; all ranks call it.

    A key marked ``allow_shape_mismatch`` reads the rows (dimension 0) that both the checkpoint and
    the target have. Returns the keys absent from the checkpoint that were not read: those ``allow_missing``
    accepts and, under a ``strict`` mode that skips them, the other "unexpected" ones (their targets are
    left unchanged).

    ``strict`` (Megatron-LM's StrictHandling, validation.py): a key absent from the checkpoint that
    ``allow_missing`` does not accept fails the load (default, ``raise_*``), is warned about and skipped
    (``log_*``) or skipped (``ignore_all``); ``*_all`` modes also look for checkpoint tensors no rank
    requests ("missing"): warned about (``log_all``) or failing the load (``raise_all``). The ``return_*``
    modes skip like ``log_*`` without a warning (a caller of this function gets the skipped keys).
    ``unread_ok``: checkpoint keys a caller leaves unread on purpose (never counted as missing).

    Raises CheckpointMismatchError naming the checkpoint and the keys when keys are missing or a
    global shape differs; the ranks agree on such a failure before reading (every rank raises,
    the others naming the failing one), so none is left waiting in DCP's collectives. An unsafe or
    unreadable ``.metadata`` or data file raises safe_loading.UnsafeCheckpointError / CheckpointFileError
    (FileNotFoundError for a missing one) naming it, on every rank.
    """
    strict = parse_strict_flag(strict)
    read_error = None
    if metadata is None:
        try:
            metadata = read_metadata(checkpoint_dir)
        except Exception as exc:  # agreed on below, so that no rank is left waiting in a collective
            read_error = exc
    _agree_or_raise(read_error, process_group, checkpoint_dir)
    stored = metadata.state_dict_metadata
    targets: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}
    chunks: List[Tuple[str, ChunkStorageMetadata]] = []
    missing, skipped, mismatched = [], [], []
    for (key, offset), item in _index(sharded).items():
        md = stored.get(key)
        if md is None:
            (skipped if allow_missing(key) else missing).append(key)
            continue
        if not isinstance(md, TensorStorageMetadata):
            mismatched.append(f"{key} (not a tensor in the checkpoint)")
            continue
        saved_shape, data, sizes = tuple(md.size), item.data, list(item.data.shape)
        expected = item.global_shape
        if item.allow_shape_mismatch and len(saved_shape) == len(expected) and saved_shape[1:] == expected[1:]:
            rows = min(sizes[0], saved_shape[0] - offset[0])
            if rows <= 0:
                continue  # padding rows this checkpoint does not have
            if rows < sizes[0]:
                data, sizes[0] = data.narrow(0, 0, rows), rows
        elif saved_shape != expected:
            mismatched.append(f"{key} (checkpoint {list(saved_shape)}, expected {list(expected)})")
            continue
        targets[(key, offset)] = data
        chunks.append((key, ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(sizes))))
    if missing and StrictHandling.skips_unexpected(strict):
        if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
            unique = sorted(set(missing))
            logger.warning(f"checkpoint {checkpoint_dir} lacks {len(unique)} requested tensor(s), left as they are "
                           f"(--dist-ckpt-strictness {strict.value}): {', '.join(unique)}")
        skipped, missing = skipped + missing, []
    unread = []
    if StrictHandling.requires_global_app_metadata(strict):
        unread = [key for key in _unread_checkpoint_tensors(stored, _index(sharded), process_group)
                  if not unread_ok(key)]
    problem = None
    if unread and strict == StrictHandling.LOG_ALL and _group_rank(process_group) == 0:
        logger.warning(f"checkpoint {checkpoint_dir} holds {len(unread)} tensor(s) that this load does not read "
                       f"(--dist-ckpt-strictness log_all): {', '.join(unread)}")
    if missing or mismatched or (unread and strict == StrictHandling.RAISE_ALL):
        parts = []
        if missing:
            unique = sorted(set(missing))
            parts.append(f"{len(unique)} tensor(s) missing, e.g. {', '.join(unique[:4])}")
        if unread and strict == StrictHandling.RAISE_ALL:
            parts.append(f"{len(unread)} checkpoint tensor(s) not read by this model (--dist-ckpt-strictness "
                         f"raise_all), e.g. {', '.join(unread[:4])}")
        if mismatched:
            parts.append(f"{len(mismatched)} tensor(s) of another shape, e.g. {', '.join(sorted(mismatched)[:4])}")
        problem = CheckpointMismatchError(f"checkpoint {checkpoint_dir} does not match this model: {'; '.join(parts)}")
    _agree_or_raise(problem, process_group, checkpoint_dir)
    load_with_planner(checkpoint_dir, ShardedLoadPlanner(targets, chunks), metadata, process_group)
    return sorted(set(skipped))


def _group_rank(process_group) -> int:
    return dist.get_rank(process_group) if dist.is_initialized() else 0


def _unread_checkpoint_tensors(stored, requested, process_group) -> List[str]:
    """The checkpoint's tensor keys that no rank of ``process_group`` requests (Megatron's "missing" keys), sorted;
    the same on every rank (the requested keys are gathered)."""
    keys = {key for key, _ in requested}
    if dist.is_initialized() and dist.get_world_size(process_group) > 1:
        gathered = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, sorted(keys), group=process_group)
        keys = set().union(*map(set, gathered))
    return sorted(key for key, md in stored.items() if isinstance(md, TensorStorageMetadata) and key not in keys)


def load_with_planner(checkpoint_dir: str, planner: LoadPlanner, metadata: Optional[Metadata] = None,
                      process_group=None, no_dist: bool = False) -> None:
    """``dcp.load`` of ``checkpoint_dir`` with ``planner`` through :class:`SafeFileSystemReader` (``metadata``:
    one already read). A failure on any rank raises on every rank the failing rank's own exception (this
    rank's if it failed), naming the file, instead of DCP's CheckpointException with every rank's traceback.
    """
    if metadata is None:  # read here: inside dcp.load a failure would be logged with a traceback and retried
        metadata = read_metadata(checkpoint_dir)
    try:
        dcp.load({}, storage_reader=SafeFileSystemReader(checkpoint_dir, metadata), planner=planner,
                 process_group=process_group, no_dist=no_dist)
    except CheckpointException as exc:
        raise _first_failure(exc, process_group) from None


def _first_failure(exc: CheckpointException, process_group=None) -> BaseException:
    """This rank's own error out of DCP's gathered failures (keyed by rank in the load's process group),
    else the first rank's (named)."""
    rank = dist.get_rank(process_group) if dist.is_initialized() else 0
    failures = exc.failures
    # The errors name the file; another rank's (gathered as an object) reads the same here.
    return failures[rank if rank in failures else min(failures)][0]


def _agree_or_raise(problem: Optional[Exception], process_group, checkpoint_dir: str) -> None:
    if dist.is_initialized():
        flag = torch.tensor([0 if problem is None else dist.get_rank() + 1], dtype=torch.long,
                            device=get_collective_device(process_group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
        failed = int(flag.item())
        if problem is None and failed:
            problem = CheckpointMismatchError(f"checkpoint {checkpoint_dir} cannot be loaded: rank {failed - 1} "
                                              "failed (see its error)")
    if problem is not None:
        raise problem


def is_dcp_checkpoint(checkpoint_dir: str) -> bool:
    """Whether ``checkpoint_dir`` holds a torch.distributed.checkpoint (its ``.metadata`` file)."""
    return os.path.isfile(os.path.join(checkpoint_dir, METADATA_FILENAME))


def is_distributed_checkpoint(checkpoint_dir: str) -> bool:
    """Whether ``checkpoint_dir`` is a torch_dist checkpoint: the one test of the format (Megatron core_v0.14's
    ``check_is_distributed_checkpoint``): its ``metadata.json``, else (checkpoints written without one) a
    torch.distributed.checkpoint ``.metadata``."""
    return os.path.isfile(os.path.join(checkpoint_dir, MEGATRON_METADATA_FILENAME)) or is_dcp_checkpoint(checkpoint_dir)
