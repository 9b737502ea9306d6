"""Read checkpoint files without running code they may hold: DCP ``.metadata`` through an allow-list unpickler,
pickled bytes and tensors through torch's weights-only loader, each failure naming the file.

torch.distributed.checkpoint reads ``.metadata`` with a plain ``pickle.load``, so a crafted file runs any
code on load. :class:`SafeFileSystemReader` is DCP's FileSystemReader with that one read replaced by
:func:`restricted_unpickle`, which admits only the classes torch (and Megatron-LM core_v0.14, whose
``.metadata`` also holds its save plans) write into it (:data:`METADATA_GLOBALS`); anything else raises
:class:`UnsafeCheckpointError` naming the file and the refused global (``module.name``), before any
object is built. Its data reads name the ``.distcp`` file an unsafe or damaged item came from.
"""
from __future__ import annotations

import importlib
import os
import pickle
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file holds pickled objects other than the data it may hold (never executed).

    ``refused``: the global (``module.name``), function or class that was refused.
    """

    def __init__(self, where: str, refused: str, what: str = "objects other than tensors and plain data"):
        super().__init__(f"refusing to load {where}: it holds {what} ({refused}); nothing in it was executed")
        self.where, self.refused, self.what = where, refused, what

    def __reduce__(self):  # DCP gathers a failing rank's exception to the others by pickling it
        return type(self), (self.where, self.refused, self.what)


class CheckpointFileError(RuntimeError):
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


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, stream, where: str):
        super().__init__(stream)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        return _resolve(f"{module}.{name}", self._where)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(self._where, f"persistent id {str(pid)[:40]}", "a persistent reference")


def restricted_unpickle(stream, where: str) -> Any:
    """Unpickle ``stream`` admitting only the globals of :data:`METADATA_GLOBALS` (and torch dtypes/layouts/
    memory formats); ``where`` names the file in errors.

    Raises UnsafeCheckpointError naming the refused global (nothing was executed), CheckpointFileError for
    data that is not a complete pickle (empty, truncated, damaged).
    """
    try:
        return _RestrictedUnpickler(stream, where).load()
    except UnsafeCheckpointError:
        raise
    except MemoryError:
        raise
    except Exception as exc:  # pickle reports damage as UnpicklingError, EOFError, UnicodeDecodeError, ValueError...
        raise CheckpointFileError(f"cannot read {where}: it is empty, truncated or corrupt "
                                  f"({type(exc).__name__}: {str(exc)[:120]})") from exc


def read_dcp_metadata(path: str) -> Metadata:
    """The DCP :class:`Metadata` pickled in the file ``path``, read by :func:`restricted_unpickle`.

    Raises FileNotFoundError, UnsafeCheckpointError, CheckpointFileError (also when the file holds
    something else than a Metadata), each naming ``path``.
    """
    where = f"checkpoint metadata {path}"
    try:
        with open(path, "rb") as stream:
            metadata = restricted_unpickle(stream, where)
    except FileNotFoundError:
        raise FileNotFoundError(f"torch_dist checkpoint metadata {path} does not exist") from None
    except OSError as exc:
        raise CheckpointFileError(f"cannot read {where} ({exc.strerror or exc})") from exc
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise CheckpointFileError(f"cannot read {where}: it holds a {type(metadata).__name__}, not the Metadata "
                                  "torch.distributed.checkpoint writes")
    if not isinstance(metadata.storage_data or {}, dict):
        raise CheckpointFileError(f"cannot read {where}: its storage_data is a {type(metadata.storage_data).__name__}, "
                                  "not the mapping torch.distributed.checkpoint writes")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            # Data files sit beside .metadata; another path would read files outside the checkpoint.
            raise CheckpointFileError(f"cannot read {where}: it names the data file {name!r}, which is not a file "
                                      "of the checkpoint directory")
    return metadata


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


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader whose ``.metadata`` read is :func:`read_dcp_metadata` (no code runs) and whose
    data reads name the ``.distcp`` file an unsafe or damaged item came from.

    ``metadata``: one already read (by :func:`read_dcp_metadata`), returned instead of reading the file again.
    """

    def __init__(self, path, metadata: Optional[Metadata] = None):
        super().__init__(path)
        self._metadata = metadata
        self._reading = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if self._metadata is not None and rank is None:
            metadata = self._metadata
        else:
            metadata = read_dcp_metadata(os.fspath(self._get_metadata_path(rank)))
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
