"""Megatron-LM's profiling flags in the training loop: a torch.profiler trace or the nsys range of chosen iterations, CUDA memory history.

Megatron-LM core_v0.14 (``megatron/training/training.py``, ``pretrain_gpt.py``) is followed for what
runs when:

* ``--profile --use-pytorch-profiler``: a ``torch.profiler.profile`` is started before the loop with
  Megatron's schedule (``wait=max(start - 1, 0)``, ``warmup=1 if start > 0 else 0``,
  ``active=end - start``, ``repeat=1``, ``record_shapes=True``, ``with_stack=True``) and stepped at the
  top of every iteration, so the 1-based iterations ``start .. end - 1`` are recorded; it is stopped
  after iteration ``end``. As in Megatron, the schedule counts the loop's own iterations: a run resumed
  at iteration N records iterations ``N + start .. N + end - 1``. The trace is a Chrome trace named as torch's ``tensorboard_trace_handler``
  names it, ``<host>_<pid>.<ns>.pt.trace.json`` in ``--tensorboard-dir`` (TensorBoard's profiler
  plugin reads it there). One difference: the handler stamps ``<ns>`` when it writes, after the
  recorded iterations have ended, so here the stamp is taken when the profiler is created. The name is
  then known while the recorded iterations run, and their step spans carry it
  (``megatron.profile.trace_file``).
* ``--profile`` alone: the CUDA profiler range for ``nsys --capture-range=cudaProfilerApi``:
  ``cudaProfilerStart`` and ``emit_nvtx(record_shapes=True)`` before the iteration after ``start``
  completed iterations, ``cudaProfilerStop`` after iteration ``end`` (1-based ``start + 1 .. end``, as in
  Megatron). Without CUDA one line says so and training goes on.
* ``--record-memory-history``: ``torch.cuda.memory._record_memory_history`` (100,000 alloc/free events
  with their stacks) from before the model is built, a snapshot pickled to ``--memory-snapshot-path`` by
  the last rank every ``--log-interval`` and on an out-of-memory error. Without CUDA one line says so.

Only the ranks in ``--profile-ranks`` profile. Nothing here runs when the flags are off.
"""
import os
import pickle
import socket
import time
from typing import Optional

import torch

from megatron.core.console import write_line
from megatron.training.config.profiling_config import ProfilingConfig

__all__ = ["RunProfiler", "start_memory_history", "dump_memory_snapshot", "trace_file_name"]

# Megatron's pretrain_gpt.py keeps this many allocator events before a snapshot.
_MEMORY_HISTORY_ENTRIES = 100_000


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def trace_file_name(stamp_ns: int, worker_name: Optional[str] = None) -> str:
    """``<worker>.<stamp_ns>.pt.trace.json``: the layout of torch's ``tensorboard_trace_handler``, whose
    default worker name is ``<hostname>_<pid>``."""
    worker = worker_name or f"{socket.gethostname()}_{os.getpid()}"
    return f"{worker}.{stamp_ns}.pt.trace.json"


class RunProfiler:
    """The profiling of one training loop, on this rank; built by :meth:`create` (None when there is
    nothing to do on this rank).

    The loop calls :meth:`begin_iteration` before each step (``completed``: iterations done so far),
    :meth:`span_attributes` inside the step span, :meth:`end_iteration` after it (``completed`` + 1),
    and :meth:`close` when it leaves (early exits included).
    """

    def __init__(self, cfg: ProfilingConfig, tensorboard_dir: Optional[str], rank: int, last_rank: bool):
        self.cfg = cfg
        self.profiling = cfg.profile and rank in cfg.profile_ranks
        self.dump_snapshots = cfg.record_memory_history and last_rank and torch.cuda.is_available()
        self.trace_path: Optional[str] = None
        self._prof = None
        self._nvtx = None
        self._recording = False
        self._recorded = []  # 1-based iterations profiled
        self._stopped = False
        if cfg.use_pytorch_profiler and not cfg.profile and rank == 0:
            # Megatron-LM ignores it silently; a user who meant to profile would wait for a trace that never comes.
            write_line("--use-pytorch-profiler has no effect without --profile: nothing is profiled")
        if not self.profiling:
            return
        if cfg.use_pytorch_profiler:
            self.trace_path = os.path.join(tensorboard_dir, trace_file_name(time.time_ns()))
            self._prof = torch.profiler.profile(
                schedule=torch.profiler.schedule(
                    wait=max(cfg.profile_step_start - 1, 0),
                    warmup=1 if cfg.profile_step_start > 0 else 0,
                    active=cfg.profile_step_end - cfg.profile_step_start,
                    repeat=1,
                ),
                on_trace_ready=self._write_trace,
                record_shapes=True,
                with_stack=True,
            )
            self._prof.start()
        elif not torch.cuda.is_available():
            write_line(f"[rank {rank}] --profile without --use-pytorch-profiler opens the CUDA profiler range for "
                       "nsys, which needs CUDA: nothing is profiled (add --use-pytorch-profiler and "
                       "--tensorboard-dir for a torch.profiler trace)")
            self.profiling = False

    @classmethod
    def create(cls, cfg: ProfilingConfig, tensorboard_dir: Optional[str]) -> Optional["RunProfiler"]:
        """A RunProfiler when this rank profiles or dumps memory snapshots, else None."""
        rank, world_size = _rank(), _world_size()
        profiler = cls(cfg, tensorboard_dir, rank, rank == world_size - 1)
        return profiler if (profiler.profiling or profiler.dump_snapshots) else None

    def _write_trace(self, prof) -> None:
        # torch's tensorboard_trace_handler, with the file name fixed in advance (see the module docstring).
        os.makedirs(os.path.dirname(self.trace_path), exist_ok=True)
        prof.export_chrome_trace(self.trace_path)

    def begin_iteration(self, completed: int) -> None:
        """Before the step that follows ``completed`` iterations: advance the profiler's schedule, or open
        the CUDA profiler range at ``--profile-step-start``."""
        if not self.profiling or self._stopped:
            return
        if self._prof is not None:
            self._prof.step()
            self._recording = self._prof.current_action in (torch.profiler.ProfilerAction.RECORD,
                                                            torch.profiler.ProfilerAction.RECORD_AND_SAVE)
        elif completed == self.cfg.profile_step_start:
            torch.cuda.cudart().cudaProfilerStart()
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._nvtx.__enter__()
            self._recording = True

    def span_attributes(self, iteration: int) -> dict:
        """Attributes for the step span of ``iteration`` (1-based, now running): the trace file's name (or
        the nsys range) when it is recorded, else none."""
        if not self._recording:
            return {}
        self._recorded.append(iteration)
        if self._prof is not None:
            return {"profile.trace_file": os.path.basename(self.trace_path)}
        return {"profile.trace_file": "nsys (cudaProfilerStart range)"}

    def end_iteration(self, completed: int, is_log_iteration: bool) -> None:
        """After the step that made ``completed`` iterations: stop profiling at ``--profile-step-end``; dump
        the memory snapshot on a log iteration (``completed % --log-interval == 0`` in Megatron)."""
        if self.profiling and not self._stopped and completed == self.cfg.profile_step_end:
            self._stop()
        if self.dump_snapshots and is_log_iteration:
            dump_memory_snapshot(self.cfg.memory_snapshot_path)

    def _stop(self) -> None:
        self._stopped, self._recording = True, False
        if self._prof is not None:
            self._prof.stop()
            if self._recorded:
                write_line(f"[rank {_rank()}] torch.profiler trace of iterations {self._recorded[0]}-"
                           f"{self._recorded[-1]} written to {self.trace_path}")
            else:
                write_line(f"[rank {_rank()}] --profile: no iteration was profiled (the loop ended before "
                           f"--profile-step-start {self.cfg.profile_step_start})")
        else:
            torch.cuda.cudart().cudaProfilerStop()
            if self._nvtx is not None:
                self._nvtx.__exit__(None, None, None)
                self._nvtx = None

    def close(self) -> None:
        """End profiling if the loop left before ``--profile-step-end`` (what was recorded is written)."""
        if self.profiling and not self._stopped:
            self._stop()


def start_memory_history(cfg: ProfilingConfig) -> None:
    """``--record-memory-history``: record the CUDA allocator's events (with stacks) from now on, and pickle
    a snapshot to ``--memory-snapshot-path`` if an allocation fails (Megatron's pretrain_gpt.py). Without
    CUDA: one line from rank 0, and nothing is recorded."""
    if not cfg.record_memory_history:
        return
    if not torch.cuda.is_available():
        if _rank() == 0:
            write_line("--record-memory-history needs CUDA: no memory history is recorded on this machine")
        return
    torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=_MEMORY_HISTORY_ENTRIES,
                                             trace_alloc_record_context=True)

    def oom_observer(device, alloc, device_alloc, device_free):
        write_line(f"[rank {_rank()}] out of memory on device {device}: saving the allocator's state to "
                   f"{cfg.memory_snapshot_path}")
        dump_memory_snapshot(cfg.memory_snapshot_path)

    torch._C._cuda_attach_out_of_memory_observer(oom_observer)


def dump_memory_snapshot(path: str) -> None:
    """Pickle ``torch.cuda.memory._snapshot()`` (segments and the recorded history) to ``path``, as Megatron
    does; open it at https://pytorch.org/memory_viz."""
    snapshot = torch.cuda.memory._snapshot()
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
