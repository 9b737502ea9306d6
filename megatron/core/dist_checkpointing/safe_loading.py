"""Read checkpoint files without running code they may hold: DCP ``.metadata`` through an allow-list unpickler,
pickled bytes and tensors through torch's weights-only loader, each failure naming the file.

torch.distributed.checkpoint reads ``.metadata`` with a plain ``pickle.load``, so a crafted file runs any
code on load. :class:`SafeFileSystemReader` is DCP's FileSystemReader with that one read replaced by
:func:`restricted_unpickle`, which admits only the classes torch (and Megatron-LM core_v0.14, whose
``.metadata`` also holds its save plans) write into it (:data:`METADATA_GLOBALS`); anything else raises
:class:`UnsafeCheckpointError` naming the file and the refused global (``module.name``), before any
object is built. It changes only objects it built (pickle's BUILD on an admitted class or function would
change it for the whole process) and never allocates more than the file holds. What the metadata
declares is then checked before anything is read or allocated (:func:`check_metadata`: chunks that tile
each tensor, no compression transforms; :func:`check_data_files`: items inside regular data files of
the checkpoint, as large as the chunks they hold). Its data reads open regular files only and name the
``.distcp`` file an unsafe or damaged item came from.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import io
import math
import os
import pathlib
import pickle
import re
import stat
import types
import zipfile
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.transformer.enums import AttnBackend, ModelType

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _reconstruct

# What a weights-only ``torch.load`` of a checkpoint file may build besides tensors and containers (Megatron
# core_v0.14's ``SAFE_GLOBALS``; ``megatron.core.safe_globals`` re-exports it under that module name): the args
# Namespace and the plain types and enums Megatron-LM (core_v0.14.0) stores in it, and numpy's RNG state pieces.
# Megatron-LM's ``megatron.core.enums.ModelType`` is read as this package's ModelType (same values for GPT);
# AttnBackend has the same import path in both packages.
SAFE_GLOBALS = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, _reconstruct, np.ndarray, np.dtype,
                AttnBackend, ModelType, (ModelType, "megatron.core.enums.ModelType")]
_UINT32_DTYPE = getattr(getattr(np, "dtypes", None), "UInt32DType", None)
if _UINT32_DTYPE is not None:  # numpy >= 1.25 pickles dtypes through their classes
    SAFE_GLOBALS.append(_UINT32_DTYPE)


def safe_globals():
    """A context in which weights-only ``torch.load`` admits :data:`SAFE_GLOBALS` (and nothing else extra).

    Unlike Megatron-LM's ``register_safe_globals`` (``torch.serialization.add_safe_globals``, process-wide),
    it admits them only for the loads inside its ``with`` block.
    """
    return torch.serialization.safe_globals(list(SAFE_GLOBALS))


class UnsafeCheckpointError(CheckpointingException, pickle.UnpicklingError):
    """A checkpoint file holds pickled objects other than the data it may hold (never executed).

    ``refused``: the global (``module.name``), function or class that was refused.
    """

    def __init__(self, where: str, refused: str, what: str = "objects other than tensors and plain data"):
        super().__init__(f"refusing to load {where}: it holds {what} ({refused}); nothing in it was executed")
        self.where, self.refused, self.what = where, refused, what

    def __reduce__(self):  # DCP gathers a failing rank's exception to the others by pickling it
        return type(self), (self.where, self.refused, self.what)


class CheckpointFileError(CheckpointingException, RuntimeError):
    """A checkpoint file that exists but cannot be read: empty, truncated, corrupt or of another kind."""


@dataclass(frozen=True)
class MCoreSavePlan(SavePlan):
    """Stand-in for ``megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan``: Megatron-LM keeps its
    ranks' save plans in ``.metadata`` (``Metadata.all_local_plans``); reading them needs the class, not its
    behaviour (a SavePlan plus per-tensor ``mcore_data``)."""

    mcore_data: Optional[Dict[str, Dict[str, Any]]] = None


_DCP = "torch.distributed.checkpoint"
# ``module.name`` -> the object it stands for (a string: imported from that module when first needed).
# The classes DCP pickles into .metadata (torch 2.x), the torch values inside them, the path type of
# StorageMeta.checkpoint_id (pathlib moved to pathlib._local in Python 3.13), and Megatron-LM's save plans.
METADATA_GLOBALS: Dict[str, Any] = {
    **{f"{_DCP}.metadata.{name}": f"{_DCP}.metadata" for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")},
    f"{_DCP}.filesystem._StorageInfo": f"{_DCP}.filesystem",
    **{f"{_DCP}.planner.{name}": f"{_DCP}.planner" for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")},
    "torch.Size": "torch",
    "torch.serialization._get_layout": "torch.serialization",
    "collections.OrderedDict": "collections",
    "builtins.set": "builtins",  # pickle protocols < 4 build sets by a call
    "builtins.frozenset": "builtins",
    **{f"{module}.{name}": "pathlib" for module in ("pathlib", "pathlib._local")
       for name in ("PosixPath", "PurePosixPath", "PureWindowsPath")},
    "megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan": MCoreSavePlan,
}


def _resolve(key: str, where: str) -> Any:
    """The object ``key`` (``module.name``) stands for, or raise UnsafeCheckpointError naming ``where``."""
    module, _, name = key.rpartition(".")
    target = METADATA_GLOBALS.get(key)
    if target is None and module == "torch" and name.isidentifier() and not name.startswith("_") and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
        return getattr(torch, name)  # TensorProperties pickles its dtype as the global torch.<dtype>
    if target is None:
        raise UnsafeCheckpointError(where, key, "a pickled global that checkpoint metadata never holds")
    if isinstance(target, str):
        return getattr(importlib.import_module(target), name)
    return target


def _describe(obj: Any) -> str:
    """``class m.C``, ``function m.f``, ``module m`` or ``a m.C object``: what a refused pickle instruction aimed at."""
    if isinstance(obj, type):
        return f"class {obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}"
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"function {getattr(obj, '__module__', '?')}.{obj.__qualname__}"
    return f"a {type(obj).__module__}.{type(obj).__qualname__} object"


def _buildable_types() -> tuple:
    """The classes whose instances a ``.metadata`` may fill by pickle's BUILD: the admitted dataclasses (what
    DCP and Megatron-LM pickle with a state). Never a class, function, module, enum member or path, which
    exist once per process: BUILD on them would change them for every later user."""
    found = []
    for key in METADATA_GLOBALS:
        target = _resolve(key, "")
        if isinstance(target, type) and dataclasses.is_dataclass(target):
            found.append(target)
    return tuple(found)


class _BoundedReader:
    """Reads of the in-memory bytes of a file that never ask for more than is left: a length declared in the
    pickle (a frame, bytes, a string) larger than the file raises CheckpointFileError naming the file,
    instead of allocating it first (a 25-byte file declaring 2**62 bytes is a MemoryError for pickle)."""

    def __init__(self, data: bytes, where: str):
        self._stream, self._size, self._where = io.BytesIO(data), len(data), where

    def _check(self, n: int) -> None:
        left = self._size - self._stream.tell()
        if n > left:
            raise CheckpointFileError(f"cannot read {self._where}: it declares {n} bytes at byte {self._stream.tell()} "
                                      f"but only {left} follow (truncated or corrupt)")

    def read(self, n: int = -1) -> bytes:
        if n is not None and n >= 0:
            self._check(n)
        return self._stream.read(n)

    def readinto(self, buffer) -> int:
        self._check(len(buffer))
        return self._stream.readinto(buffer)

    def readline(self) -> bytes:
        return self._stream.readline()


class _RestrictedUnpickler(pickle._Unpickler):  # the Python implementation: its opcodes can be checked one by one
    """An unpickler that admits only :data:`METADATA_GLOBALS` and changes only objects it built itself.

    As torch's weights-only unpickler does: BUILD (setting attributes) only on instances of admitted
    dataclasses, items only into dicts, list items only into lists, set items only into sets; copyreg
    extension codes never (they are looked up in a process-wide cache, not through ``find_class``).
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, stream, where: str):
        super().__init__(stream)
        self._where = where
        self._buildable = _buildable_types()

    def find_class(self, module: str, name: str) -> Any:
        return _resolve(f"{module}.{name}", self._where)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(self._where, f"persistent id {str(pid)[:40]}", "a persistent reference")

    def _refuse_change(self, opcode: str, target: Any) -> None:
        raise UnsafeCheckpointError(self._where, f"pickle {opcode} on {_describe(target)}",
                                    "an instruction that would change an object it did not build")

    def _target(self) -> Any:
        """The object below the topmost MARK (what APPENDS/SETITEMS/ADDITEMS change)."""
        return self.metastack[-1][-1] if self.metastack else None

    def load_build(self) -> None:
        if len(self.stack) < 2:
            raise pickle.UnpicklingError("BUILD with an empty stack")
        state, target = self.stack[-1], self.stack[-2]
        if type(target) not in self._buildable:
            self._refuse_change("BUILD", target)
        if getattr(type(target), "__setstate__", None) is None:
            # As torch's weights-only unpickler: a plain __dict__ update, never setattr (no slot state), and
            # only attribute names (a dunder such as __class__ would change what the object is).
            if not isinstance(state, dict) or not all(type(k) is str and not k.startswith("__") for k in state):
                raise UnsafeCheckpointError(self._where, f"pickle BUILD on {_describe(target)} with a "
                                            f"{type(state).__name__} state", "an instruction that sets more than "
                                            "the attributes of an object it built")
        super().load_build()

    def load_setitem(self) -> None:
        if len(self.stack) < 3 or type(self.stack[-3]) not in (dict, OrderedDict):
            self._refuse_change("SETITEM", self.stack[-3] if len(self.stack) >= 3 else None)
        super().load_setitem()

    def load_setitems(self) -> None:
        if type(self._target()) not in (dict, OrderedDict):
            self._refuse_change("SETITEMS", self._target())
        super().load_setitems()

    def load_append(self) -> None:
        if len(self.stack) < 2 or type(self.stack[-2]) is not list:
            self._refuse_change("APPEND", self.stack[-2] if len(self.stack) >= 2 else None)
        super().load_append()

    def load_appends(self) -> None:
        if type(self._target()) is not list:
            self._refuse_change("APPENDS", self._target())
        super().load_appends()

    def load_additems(self) -> None:
        if type(self._target()) is not set:
            self._refuse_change("ADDITEMS", self._target())
        super().load_additems()

    def load_extension(self) -> None:
        raise UnsafeCheckpointError(self._where, "a copyreg extension code", "a reference to a registered global")

    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.APPEND[0]] = load_append
    dispatch[pickle.APPENDS[0]] = load_appends
    dispatch[pickle.ADDITEMS[0]] = load_additems
    for _opcode in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_opcode[0]] = load_extension
    del _opcode


def restricted_unpickle(stream, where: str) -> Any:
    """Unpickle ``stream`` (bytes or a binary file, read whole) admitting only the globals of
    :data:`METADATA_GLOBALS` (and torch dtypes/layouts/memory formats) and changing only objects it built
    (:class:`_RestrictedUnpickler`); ``where`` names the file in errors.

    Raises UnsafeCheckpointError naming the refused global or instruction (nothing was executed, no
    class or function was changed), CheckpointFileError for data that is not a complete pickle (empty,
    truncated, damaged, or declaring more bytes than it holds).
    """
    data = stream if isinstance(stream, (bytes, bytearray)) else stream.read()
    try:
        return _RestrictedUnpickler(_BoundedReader(bytes(data), where), where).load()
    except (UnsafeCheckpointError, CheckpointFileError):
        raise
    except RecursionError as exc:
        raise CheckpointFileError(f"cannot read {where}: it is nested too deeply") from exc
    except Exception as exc:  # pickle reports damage as UnpicklingError, EOFError, UnicodeDecodeError, ValueError...
        raise CheckpointFileError(f"cannot read {where}: it is empty, truncated or corrupt "
                                  f"({type(exc).__name__}: {str(exc)[:120]})") from exc


def read_regular_file(path: str, where: str) -> bytes:
    """The bytes of ``path``, which must be a regular file: opened without blocking (a FIFO or device would
    never end a read) and checked after the open. Raises FileNotFoundError, CheckpointFileError naming
    ``where`` for anything else (a directory, FIFO, device, socket; a read error)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CheckpointFileError(f"cannot read {where} ({exc.strerror or exc})") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointFileError(f"cannot read {where}: it is not a regular file ({_file_kind(info.st_mode)})")
        chunks, left = [], info.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 8 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise CheckpointFileError(f"cannot read {where} ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)


def not_a_regular_file(path: str) -> Optional[str]:
    """What ``path`` is when it exists but is not a regular file (after links): ``"a FIFO"``, ``"a character
    device"``..., else None. A reader checks it before an open that would block (a FIFO) or never end (a
    link to ``/dev/zero``)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # missing or unreadable: the open that follows reports it
    return None if stat.S_ISREG(mode) else _file_kind(mode)


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def read_dcp_metadata(path: str) -> Metadata:
    """The DCP :class:`Metadata` pickled in the file ``path``, read by :func:`restricted_unpickle` and checked
    by :func:`check_metadata` (what it holds is well formed, each tensor's chunks cover it exactly).

    Raises FileNotFoundError, UnsafeCheckpointError, CheckpointFileError (also when the file holds
    something else than a Metadata, or is not a regular file), each naming ``path``.
    """
    where = f"checkpoint metadata {path}"
    try:
        data = read_regular_file(path, where)
    except FileNotFoundError:
        raise FileNotFoundError(f"torch_dist checkpoint metadata {path} does not exist") from None
    metadata = restricted_unpickle(data, where)
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise CheckpointFileError(f"cannot read {where}: it holds a {type(metadata).__name__}, not the Metadata "
                                  "torch.distributed.checkpoint writes")
    if not isinstance(metadata.storage_data or {}, dict):
        raise CheckpointFileError(f"cannot read {where}: its storage_data is a {type(metadata.storage_data).__name__}, "
                                  "not the mapping torch.distributed.checkpoint writes")
    check_metadata(metadata, where)
    return metadata


def _is_size(value: Any, ndim: Optional[int] = None) -> bool:
    return (isinstance(value, tuple) and all(type(d) is int and d >= 0 for d in value)
            and (ndim is None or len(value) == ndim))


def check_metadata(metadata: Metadata, where: str) -> None:
    """Check what a DCP ``metadata`` (read from ``where``) holds before anything is read or allocated.

    - every data item names a file beside ``.metadata`` (another path would read outside the checkpoint),
      at a non-negative offset and length, with no ``transform_descriptors`` (this project writes none;
      a ``stream.zstd`` one would inflate a small item into gigabytes);
    - every tensor entry has a dtype, a size of non-negative integers, and chunks that lie inside that
      size and cover it exactly, without gaps or overlaps (otherwise a load would leave part of the
      tensor at its initial values and report success).

    Raises CheckpointFileError naming ``where`` and the key.
    """
    for index, info in (metadata.storage_data or {}).items():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", "..") or "\0" in name:
            # Data files sit beside .metadata; another path would read files outside the checkpoint.
            raise CheckpointFileError(f"cannot read {where}: it names the data file {name!r}, which is not a file "
                                      "of the checkpoint directory")
        key = getattr(index, "fqn", index)
        if type(getattr(info, "offset", None)) is not int or type(getattr(info, "length", None)) is not int \
                or info.offset < 0 or info.length < 0:
            offset, length = getattr(info, "offset", None), getattr(info, "length", None)
            raise CheckpointFileError(f"cannot read {where}: the data item of {key} has offset {offset!r} and "
                                      f"length {length!r}, not two non-negative integers")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointFileError(f"cannot read {where}: the data item of {key} is stored with the transforms "
                                      f"{list(info.transform_descriptors)[:4]!r} (e.g. compression), which this "
                                      "project never writes")
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            _check_chunks(key, md, where)
        elif not isinstance(md, BytesStorageMetadata):
            raise CheckpointFileError(f"cannot read {where}: its entry {key} is a {type(md).__name__}, neither a "
                                      "tensor nor a pickled object")


def _check_chunks(key: str, md: TensorStorageMetadata, where: str) -> None:
    """Raise CheckpointFileError unless the chunks of the tensor entry ``md`` tile its size exactly."""
    size = getattr(md, "size", None)
    if not _is_size(size) or not isinstance(getattr(getattr(md, "properties", None), "dtype", None), torch.dtype):
        raise CheckpointFileError(f"cannot read {where}: tensor {key} has the size {size!r} and dtype "
                                  f"{getattr(getattr(md, 'properties', None), 'dtype', None)!r}; a tensor needs "
                                  "non-negative integer sizes and a torch dtype")
    chunks = getattr(md, "chunks", None)
    if not isinstance(chunks, list):
        raise CheckpointFileError(f"cannot read {where}: the chunks of tensor {key} are a {type(chunks).__name__}, "
                                  "not a list")
    ndim, boxes, volume = len(size), [], 0
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not (_is_size(offsets, ndim) and _is_size(sizes, ndim)) or \
                any(o + s > d for o, s, d in zip(offsets, sizes, size)):
            raise CheckpointFileError(f"cannot read {where}: tensor {key} of size {list(size)} has a chunk at offsets "
                                      f"{_shown(offsets)} of sizes {_shown(sizes)}, which does not lie inside it")
        count = math.prod(sizes)
        if count:
            volume += count
            boxes.append((tuple(offsets), tuple(sizes)))
    total = math.prod(size)
    overlap = _overlapping(boxes, ndim)
    if overlap is not None:
        (o1, s1), (o2, s2) = overlap
        raise CheckpointFileError(f"cannot read {where}: tensor {key} has overlapping chunks (at offsets {list(o1)} "
                                  f"of sizes {list(s1)} and at {list(o2)} of sizes {list(s2)})")
    if volume != total:
        raise CheckpointFileError(f"cannot read {where}: the chunks of tensor {key} hold {volume} of its {total} "
                                  f"elements (size {list(size)}); part of it is not in the checkpoint")


def _shown(value: Any) -> str:
    return str(list(value)) if isinstance(value, tuple) else repr(value)[:80]


def _overlapping(boxes, ndim: int):
    """Two of ``boxes`` (``(offsets, sizes)``, all non-empty) that overlap, or None: a sweep along the dimension
    with the most distinct offsets, comparing each box with those still open there."""
    if len(boxes) < 2:
        return None
    if ndim == 0:
        return boxes[0], boxes[1]  # two chunks of one element
    axis = max(range(ndim), key=lambda d: len({offsets[d] for offsets, _ in boxes}))
    active = []
    for box in sorted(boxes, key=lambda b: b[0][axis]):
        start = box[0][axis]
        active = [a for a in active if a[0][axis] + a[1][axis] > start]
        for other in active:
            if all(other[0][d] < box[0][d] + box[1][d] and box[0][d] < other[0][d] + other[1][d] for d in range(ndim)):
                return other, box
        active.append(box)
    return None


def check_inside(checkpoint_dir: str, name: str) -> None:
    """Raise CheckpointFileError naming the file unless ``checkpoint_dir/name`` (a file of the directory) is
    still inside ``checkpoint_dir`` once links are resolved: a link out of it would read another file."""
    path = os.path.join(checkpoint_dir, name)
    real = os.path.realpath(path)
    if os.path.dirname(real) != os.path.realpath(checkpoint_dir):
        raise CheckpointFileError(f"cannot read checkpoint file {path}: it is a link to {real}, outside the "
                                  "checkpoint directory")


def check_data_files(metadata: Metadata, checkpoint_dir: str) -> None:
    """Check the DCP ``metadata`` of ``checkpoint_dir`` against its data files before anything is allocated.

    Each data file must be a regular file inside ``checkpoint_dir`` (not a link out of it, a FIFO or a
    device); each item must lie inside its file, apart from the others; each tensor chunk must have a data
    item at least as large as the chunk's bytes (so a declared size of 2**40 elements, which no data file
    holds, is refused here rather than allocated). Raises CheckpointFileError naming the file and key.
    """
    where = f"checkpoint metadata {os.path.join(checkpoint_dir, '.metadata')}"
    sizes: Dict[str, int] = {}
    items: Dict[str, list] = {}
    for index, info in (metadata.storage_data or {}).items():
        name = info.relative_path
        if name not in sizes:
            path = os.path.join(checkpoint_dir, name)
            try:
                status = os.stat(path)
            except FileNotFoundError:
                raise CheckpointFileError(f"checkpoint data file {path} does not exist (listed in {where}): "
                                          "the checkpoint is incomplete") from None
            except OSError as exc:
                raise CheckpointFileError(f"cannot read checkpoint file {path} (named by {where}): "
                                          f"{exc.strerror or exc}") from None
            check_inside(checkpoint_dir, name)
            if not stat.S_ISREG(status.st_mode):
                raise CheckpointFileError(f"cannot read checkpoint file {path}: it is not a regular file "
                                          f"({_file_kind(status.st_mode)})")
            sizes[name] = status.st_size
        if info.offset + info.length > sizes[name]:
            raise CheckpointFileError(f"cannot read {where}: the data item of {getattr(index, 'fqn', index)} ends at "
                                      f"byte {info.offset + info.length} of {name}, which has {sizes[name]} bytes")
        items.setdefault(name, []).append((info.offset, info.length, getattr(index, "fqn", index)))
    for name, spans in items.items():  # DCP writes items one after another: shared bytes would let
        spans.sort(key=lambda span: span[:2])  # many large chunks claim one small item
        for (start, length, key), (next_start, next_length, next_key) in zip(spans, spans[1:]):
            if length and next_length and next_start < start + length:
                raise CheckpointFileError(f"cannot read {where}: the data items of {key} and {next_key} overlap "
                                          f"in {name} (bytes {start}-{start + length} and {next_start}-"
                                          f"{next_start + next_length})")
    storage = metadata.storage_data or {}
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        itemsize = md.properties.dtype.itemsize
        for chunk in md.chunks:
            count = math.prod(chunk.sizes)
            if not count:
                continue
            info = storage.get(MetadataIndex(key, chunk.offsets))
            if info is None:
                raise CheckpointFileError(f"cannot read {where}: tensor {key} has no data item for its chunk at "
                                          f"offsets {list(chunk.offsets)}")
            if info.length < count * itemsize:
                raise CheckpointFileError(f"cannot read {where}: tensor {key} declares a chunk of {count} elements "
                                          f"({count * itemsize} bytes) at offsets {list(chunk.offsets)}, but its data "
                                          f"item in {info.relative_path} holds {info.length} bytes")


_REFUSED = (re.compile(r"GLOBAL ([\w.]+)"), re.compile(r"unrecognized function (.+?)(?: which belongs|$)"),
            re.compile(r"(?:Can only create new object|Can only build).* got (.+)$"))


def checked_tensor_load(load, where: str) -> Any:
    """``load()`` (a weights-only ``torch.load``) with torch's sparse-tensor checks on, then
    :func:`check_dense_tensors` on what it returned.

    torch skips the index checks of loaded sparse tensors unless asked, and a sparse tensor whose indices
    point outside its size writes out of bounds when copied into a dense one; checkpoints hold dense
    tensors only. Raises CheckpointFileError naming ``where``; what ``load`` raises passes through.
    """
    with torch.sparse.check_sparse_tensor_invariants(enable=True):
        loaded = load()
    check_dense_tensors(loaded, where)
    return loaded


def check_dense_tensors(obj: Any, where: str) -> None:
    """Raise CheckpointFileError naming ``where`` and the entry when ``obj`` (nested dicts, lists, tuples,
    Namespaces) holds a tensor that is not dense (sparse, quantized...) or that repeats one element along
    a dimension (stride 0: a few bytes on disk that expand to any size when copied, e.g. terabytes)."""
    stack, seen = [(obj, "")], set()
    while stack:
        value, key = stack.pop()
        if id(value) in seen:  # pickle's memo can make a container hold itself
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided or value.is_quantized:
                problem = f"a {value.layout} tensor"
            elif any(stride == 0 and size > 1 for size, stride in zip(value.shape, value.stride())):
                problem = f"a tensor of shape {list(value.shape)} that repeats one element (stride 0)"
            else:
                continue
            raise CheckpointFileError(f"cannot read {where}: it holds {problem} at {key or 'its top level'}; "
                                      "checkpoints hold dense tensors only")
        if isinstance(value, dict):
            stack.extend((item, _entry(key, name)) for name, item in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((item, _entry(key, index)) for index, item in enumerate(value))
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            stack.extend((item, _entry(key, name)) for name, item in vars(value).items())


def _entry(parent: str, name: Any) -> str:
    return f"{parent}/{name}" if parent else f"entry {name}"


def refused_by_weights_only(exc: BaseException) -> Optional[str]:
    """What torch's weights-only loader refused (``module.name`` of a global, or a function or class it
    would have called) when ``exc`` is such a refusal; None for other errors (damaged data)."""
    if not isinstance(exc, pickle.UnpicklingError):
        return None
    for line in str(exc).splitlines():
        for pattern in _REFUSED:
            match = pattern.search(line.strip())
            if match:
                return match.group(1).strip().rstrip(".")
    return None


def weights_only_load(stream, where: str, safe_globals: Iterable[Any] = ()) -> Any:
    """``torch.load(stream, weights_only=True)`` on the CPU with ``safe_globals`` allowed; ``where`` names the
    data in errors. Raises UnsafeCheckpointError naming what was refused, CheckpointFileError otherwise."""
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return checked_tensor_load(lambda: torch.load(stream, map_location="cpu", weights_only=True), where)
    except (MemoryError, CheckpointFileError):
        raise
    except Exception as exc:
        refused = refused_by_weights_only(exc)
        if refused is not None:
            raise UnsafeCheckpointError(where, refused) from exc
        raise CheckpointFileError(f"cannot read {where}: it is truncated or corrupt "
                                  f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
                                  ) from exc


class _RegularFileSystem(FileSystem):
    """DCP's local file system whose streams open regular files only, without blocking on a FIFO or device."""

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode != "rb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            mode_bits = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode_bits):
                raise CheckpointFileError(f"cannot read checkpoint file {os.fspath(path)}: it is not a regular file "
                                          f"({_file_kind(mode_bits)})")
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "rb") as stream:
            yield stream


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader whose ``.metadata`` read is :func:`read_dcp_metadata` (no code runs) and whose
    data reads name the ``.distcp`` file an unsafe or damaged item came from.

    ``metadata``: one already read (by :func:`read_dcp_metadata`), returned instead of reading the file again.
    """

    def __init__(self, path, metadata: Optional[Metadata] = None):
        super().__init__(path)
        self.fs = _RegularFileSystem()
        self._metadata = metadata
        self._reading = None

    def read_metadata(self, *args: Any, **options: Any) -> Metadata:
        rank = options.get("rank")
        if self._metadata is not None and rank is None:
            metadata = self._metadata
        else:
            path = os.fspath(self._get_metadata_path(rank))
            check_inside(os.fspath(self.path), os.path.basename(path))
            metadata = read_dcp_metadata(path)
            check_data_files(metadata, os.fspath(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return metadata

    def _slice_file(self, file, sinfo):
        self._reading = sinfo.relative_path  # which file a failing item came from
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):
        try:
            with torch.sparse.check_sparse_tensor_invariants(enable=True):  # see checked_tensor_load
                return super().read_data(plan, planner)
        except MemoryError:
            raise
        except Exception as exc:  # torch.load of a tensor item, a planner's load_bytes, a short file...
            where = f"checkpoint file {os.path.join(os.fspath(self.path), self._reading or '?')}"
            refused = exc.refused if isinstance(exc, UnsafeCheckpointError) else refused_by_weights_only(exc)
            if refused is not None:
                raise UnsafeCheckpointError(where, refused) from exc
            cause = exc.__cause__ if isinstance(exc, CheckpointFileError) and exc.__cause__ is not None else exc
            raise CheckpointFileError(f"cannot read {where}: it is truncated or corrupt ({type(cause).__name__}: "
                                      f"{str(cause).splitlines()[0][:120] if str(cause) else ''})") from exc


# ---------------------------------------------------------------------------------------------------
# One checkpoint file read with torch.load (was megatron.training.checkpointing.load_state_dict_file)
# ---------------------------------------------------------------------------------------------------

class CheckpointReadError(CheckpointFileError):
    """A checkpoint file that exists but cannot be loaded: empty, truncated, corrupt or not a checkpoint."""


# torch.save writes a zip archive (since torch 1.6); older versions wrote a bare pickle (protocol 2).
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTO = b"\x80"


def torch_error_summary(exc):
    """One line of what torch.load said (its weights-only messages are many lines of advice)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if "WeightsUnpickler error" in line:
            rest = line.split("WeightsUnpickler error:", 1)[1].strip() or (lines[i + 1] if i + 1 < len(lines) else "")
            return f"{type(exc).__name__}: {rest}"[:200]
    return f"{type(exc).__name__}: {lines[0] if lines else exc!r}"[:200]


def unreadable_reason(path, exc):
    """What is wrong with ``path``, which torch.load failed on with ``exc``, judged from its bytes."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(len(_ZIP_MAGIC))
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    if size == 0:
        return "is empty (0 bytes): a save or copy that never wrote it"
    if head == _ZIP_MAGIC[:len(head)]:
        if len(head) < len(_ZIP_MAGIC) or not zipfile.is_zipfile(path):
            return (f"is truncated ({size} bytes; the zip archive torch.save writes ends before its "
                    "end-of-archive record): a save or copy that was cut short")
        return f"is corrupt: its zip archive is complete but its contents cannot be read ({torch_error_summary(exc)})"
    if head.startswith(_PICKLE_PROTO):
        return (f"is truncated or corrupt ({size} bytes in the pickle format of torch.save before 1.6; "
                f"{torch_error_summary(exc)})")
    return f"is not a checkpoint: it does not start like a file torch.save writes (first bytes {head!r}, {size} bytes)"


def load_torch_file(path, context=None):
    """``torch.load(path, weights_only=True)`` on the CPU, admitting only :data:`SAFE_GLOBALS`.

    ``context`` (e.g. ``"iteration 8 of --load DIR"``) is added to error messages after the path.
    Raises UnsafeCheckpointError (a pickle.UnpicklingError) naming the file and the refused global
    (``module.name``) when it holds objects other than tensors and plain data (arbitrary pickled
    objects are never executed), and CheckpointReadError (a CheckpointFileError) naming the file and saying
    what is wrong for any other unreadable file: cannot be opened, empty, truncated, corrupt, or not
    written by torch.save.
    """
    where = f"{path} ({context})" if context else f"{path}"
    kind = not_a_regular_file(path)
    if kind is not None:  # torch.load would block on a FIFO and never end on a device
        raise CheckpointReadError(f"cannot read checkpoint file {where}: it is {kind}, not a regular file")
    try:
        with safe_globals():
            return checked_tensor_load(lambda: torch.load(path, map_location="cpu", weights_only=True),
                                       f"checkpoint file {where}")
    except (MemoryError, CheckpointFileError):  # too big for this host (not damaged); or already named
        raise
    except Exception as exc:  # torch.load reports damage as EOFError, OSError(EINVAL), KeyError, RuntimeError...
        refused = refused_by_weights_only(exc)
        if refused is not None:
            raise UnsafeCheckpointError(f"checkpoint {where}", refused) from exc
        raise CheckpointReadError(f"cannot read checkpoint file {where}: it {unreadable_reason(path, exc)}") from exc
