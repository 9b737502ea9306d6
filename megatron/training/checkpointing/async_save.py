"""Write a torch_dist checkpoint now or in the background (``--async-save``).

Synchronous: every rank writes its chunks with torch.distributed.checkpoint before returning.

Asynchronous: ``save_checkpoint`` returns as soon as the small pieces (``common.pt``, this rank's
RNG file) are written and a background thread has been started. That thread first copies every
tensor into host buffers kept from one save to the next (no allocation after the first save),
then writes the copies with DCP over a process group of its own, so its collectives never mix
with the training loop's. The loop does not wait for the copy unless it is about to change the
parameters: ``wait_for_async_staging`` (called before the optimizer step) blocks only until the
copy is complete, so the saved state is exactly the state of the save iteration. Publishing (the
rename and the tracker) happens on the training thread in ``saving.finalize_async_save``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import model_and_optimizer as mo
from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.training.checkpointing.collectives import world_rank
from megatron.training.checkpointing.durable import fault_point, write_durably
from megatron.training.checkpointing.layout import common_file_name, rng_file_name
from megatron.training.checkpointing.manifest import digest_files
from megatron.training.utils import get_device

# Host copies reused across async saves: {(key, global offset): tensor}. A buffer is rewritten only
# by the next save, which starts after the previous one was finalized.
_HOST_BUFFERS: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}
_WRITER_GROUP = None


def _writer_group():
    """A gloo group of all ranks for the background writer's DCP collectives (created once, collectively)."""
    global _WRITER_GROUP
    if _WRITER_GROUP is None and dist.is_initialized():
        _WRITER_GROUP = dist.new_group(backend="gloo")
    return _WRITER_GROUP


def sharded_state_to_save(args, model, optimizer) -> List[ShardedTensor]:
    """This rank's chunks of the model and (unless --no-save-optim) the optimizer state."""
    sharded = mo.model_sharded_state(model, with_objects=True)
    if optimizer is not None and not args.no_save_optim:
        sharded += mo.optimizer_sharded_state(model, optimizer)
    return sharded


def _write_small_files(tmp_dir, common, rng_state):
    rank = world_rank()
    if rank == 0:
        write_durably(common, common_file_name(tmp_dir))
    if rng_state is not None:
        write_durably({"rng_state": rng_state, "parallel_layout": common["parallel_layout"]},
                      rng_file_name(tmp_dir, rank))


def start_torch_dist_save(args, tmp_dir, model, optimizer, common, rng_state, asynchronous=False):
    """Write a torch_dist checkpoint into ``tmp_dir``; all ranks call it.

    Returns None once written (synchronous), or the started :class:`AsyncTorchDistWriter`.
    """
    sharded = sharded_state_to_save(args, model, optimizer)
    if rng_state is not None:  # for Megatron-LM's loader; this project restores from rng/rank_XXXXX.pt
        sharded.append(mo.rng_state_object(rng_state))
    _write_small_files(tmp_dir, common, rng_state)
    if not asynchronous:
        serialization.save(sharded, tmp_dir)
        return None
    return AsyncTorchDistWriter(sharded, tmp_dir, _writer_group(), _worker_attributes(args),
                                iteration=common["iteration"])


def staging_device() -> Optional[int]:
    """The CUDA device whose tensors a save copies: the calling (training) thread's current device, or
    None without CUDA. Recorded when the save is scheduled, because a new thread's current device is
    always 0 (CUDA keeps the current device per thread), whatever ``LOCAL_RANK`` the process serves."""
    device = get_device()  # the one place that reads the model's device
    return device.index if device.type == "cuda" else None


def _stage(sharded: List[ShardedTensor], ready=None, device: Optional[int] = None) -> List[ShardedTensor]:
    """Copies of ``sharded`` in the reused host buffers (pinned when ``device`` is a CUDA device).

    With a ``device`` the copies run on a side stream of that device that first waits for ``ready``
    (an event recorded on the training stream when the save started), so they overlap the next
    forward/backward; the call returns once an event recorded on that same stream after the last
    copy has completed, so the host buffers hold the data before anything reads them. The caller's
    thread must have ``device`` as its current device (``AsyncTorchDistWriter`` sets it).
    """
    staged = []
    pin = device is not None
    stream = None
    if pin:
        stream = torch.cuda.Stream(device=device)
        if ready is not None:
            stream.wait_event(ready)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for item in sharded:
            if isinstance(item, ShardedObject):
                staged.append(item)  # bytes: already a copy
                continue
            if item.replica or item.data.numel() == 0:
                continue
            slot = (item.key, item.global_offset)
            buffer = _HOST_BUFFERS.get(slot)
            if buffer is None or buffer.shape != item.data.shape or buffer.dtype != item.data.dtype:
                buffer = torch.empty(item.data.shape, dtype=item.data.dtype, device="cpu", pin_memory=pin)
                _HOST_BUFFERS[slot] = buffer
            buffer.copy_(item.data, non_blocking=pin)
            staged.append(dataclasses.replace(item, data=buffer))
    if stream is not None:
        copied = torch.cuda.Event()
        copied.record(stream)
        copied.synchronize()
    return staged


def _worker_attributes(args) -> Dict:
    """Span attributes of the background writer from the shared worker bootstrap (rank, service, resource)."""
    from megatron.core.telemetry import build_otel_worker_bootstrap

    bootstrap = build_otel_worker_bootstrap(args)
    attrs = {"megatron.worker": "async_checkpoint_writer", "megatron.rank": bootstrap.get("rank"),
             "megatron.world_size": bootstrap.get("world_size"), "service.name": bootstrap.get("service_name")}
    for key, value in (bootstrap.get("resource_attrs") or {}).items():
        attrs.setdefault(key, value)
    return {k: v for k, v in attrs.items() if v is not None}


def _files_written_by(checkpoint_dir, group) -> List[str]:
    """The files this rank's DCP write produced in ``checkpoint_dir``: its ``__<rank>_<i>.distcp`` data
    files (FileSystemWriter's naming, rank within ``group``) and, on the coordinator, ``.metadata``."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    names = [name for name in os.listdir(checkpoint_dir)
             if name.startswith(f"__{rank}_") and name.endswith(".distcp")]
    if rank == 0:
        names += [name for name in (serialization.METADATA_FILENAME, serialization.MEGATRON_METADATA_FILENAME)
                  if os.path.isfile(os.path.join(checkpoint_dir, name))]
    return sorted(names)


def _current_context():
    try:
        from opentelemetry import context as otel_context
    except ImportError:  # telemetry extras not installed: spans are no-ops anyway
        return None
    return otel_context.get_current()


class AsyncTorchDistWriter:
    """One rank's background copy-then-write of a torch_dist checkpoint (see the module docstring).

    The background span ``megatron.save_checkpoint.background`` (group ``checkpoint``) and the
    publishing span ``megatron.save_checkpoint.finalize`` are children of the ``megatron.save_checkpoint``
    span during which the save started, so a trace shows the blocking part, the background part and
    the finalize.
    """

    def __init__(self, sharded, checkpoint_dir, process_group, attributes, iteration):
        self._sharded = sharded
        self._dir = checkpoint_dir
        self._group = process_group
        self._attributes = dict(attributes, **{"megatron.iteration": iteration})
        self._context = _current_context()
        # The state to copy is what the training stream of this rank's GPU has computed up to now.
        self._device = staging_device()
        self._ready = None
        if self._device is not None:
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(self._device))
        self._staged = threading.Event()
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self.staging_seconds = None
        self.writing_seconds = None
        self.digests = None  # {relative path: {"size", "crc32"}} of the files this rank's write produced
        self._thread = threading.Thread(target=self._run, name=f"async-ckpt-{iteration}", daemon=True)
        self._thread.start()

    def _run(self):
        from megatron.core.telemetry import managed_span

        try:
            if self._device is not None:
                # Before any CUDA call of this thread: else its stream, its event and a CUDA context
                # would be on GPU 0 while the tensors live on this rank's GPU.
                torch.cuda.set_device(self._device)
            with managed_span("checkpoint", "megatron.save_checkpoint.background", context=self._context,
                              **self._attributes):
                start = time.perf_counter()
                try:
                    staged = _stage(self._sharded, self._ready, self._device)
                finally:
                    self._sharded = None  # the live tensors are no longer referenced
                    self.staging_seconds = time.perf_counter() - start
                    self._staged.set()
                start = time.perf_counter()
                serialization.save(staged, self._dir, process_group=self._group)
                # The manifest's CRC-32s of this rank's files, here rather than on the training thread
                # at the publish (which digests only what is not known, e.g. common.pt).
                self.digests = digest_files(self._dir, _files_written_by(self._dir, self._group))
                self.writing_seconds = time.perf_counter() - start
                fault_point("in_write", self._attributes["megatron.iteration"])
        except BaseException as exc:  # reported to every rank by finalize_async_save
            self._error = exc
        finally:
            self._staged.set()
            self._done.set()

    def wait_staged(self):
        """Block until this rank's state is copied to host memory (the live tensors may change after)."""
        self._staged.wait()

    def done(self) -> bool:
        """Whether this rank's background write has finished (successfully or not)."""
        return self._done.is_set()

    def wait(self) -> Optional[BaseException]:
        """Join the background thread; returns its error or None."""
        self._thread.join()
        return self._error

    def publish_span(self, publish):
        """Run ``publish()`` under the ``megatron.save_checkpoint.finalize`` span."""
        from megatron.core.telemetry import managed_span

        with managed_span("checkpoint", "megatron.save_checkpoint.finalize", context=self._context,
                          **self._attributes):
            publish()

