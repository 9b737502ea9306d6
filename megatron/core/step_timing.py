"""Where a training step's time goes: exclusive wall time of its parts (compute, communication, data, optimizer).

A part (``forward_compute``, ``tp_comm``, ...) is a section opened and closed around the code that does
it; sections nest, and each one is charged its *exclusive* time (its wall time minus that of the
sections opened inside it), so the parts of a step never double count: the tensor-parallel all-reduce
inside a forward pass is ``tp_comm``, not ``forward_compute``; the batch fetched inside
``forward_step_func`` is ``data_wait``. What no section covers is ``other``.

Clocks: on the CPU (or a CPU-only run) a section is timed with ``time.perf_counter``. With CUDA the
marks are CUDA events on the current stream, resolved once per ``take()`` (one synchronize per log
interval): a part then measures the GPU timeline, so a host-side wait (for data, for a collective on
another stream) is charged to the part during which the GPU stood still for it, and no section adds
a device synchronize.

Nothing here runs unless a recorder is installed (``install``); ``section(part)`` is then a shared
``nullcontext`` (no allocation, no clock read), so instrumented code costs a global lookup.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, List, Optional

import torch

__all__ = ["PARTS", "TIMER_PARTS", "StepTimeRecorder", "install", "uninstall", "active_recorder", "section"]

# The parts of a step, in report order (metric ``megatron.training.step.<part>_ms``).
PARTS = ("forward_compute", "backward_compute", "data_wait", "tp_comm", "pp_comm", "cp_comm", "ep_comm", "grad_sync",
         "optimizer")

# Megatron's timer names (megatron/core/timers.py users) -> the part they time.
TIMER_PARTS: Dict[str, str] = {
    "forward-compute": "forward_compute",
    "backward-compute": "backward_compute",
    "batch-generator": "data_wait",
    "all-grads-sync": "grad_sync",
    "layernorm-grads-all-reduce": "grad_sync",
    "embedding-grads-all-reduce": "grad_sync",
    "forward-recv": "pp_comm",
    "forward-send": "pp_comm",
    "backward-recv": "pp_comm",
    "backward-send": "pp_comm",
    "forward-send-backward-recv": "pp_comm",
    "backward-send-forward-recv": "pp_comm",
    "forward-backward-send-forward-backward-recv": "pp_comm",
    # The context-parallel attention kernels' K/V exchange (transformer/context_parallel/comm.py).
    "cp-comm": "cp_comm",
    # The MoE token dispatchers' expert-parallel exchange (transformer/moe/ep_comm.py).
    "ep-comm": "ep_comm",
    "optimizer": "optimizer",
}

_NULL = contextlib.nullcontext()


class _HostMarks:
    """perf_counter marks; ``elapsed`` in seconds."""

    deferred = False

    @staticmethod
    def mark():
        return time.perf_counter()

    @staticmethod
    def elapsed(start, end) -> float:
        return end - start

    @staticmethod
    def resolve() -> None:
        pass


class _CudaEventMarks:
    """CUDA events on the current stream; ``elapsed`` (seconds) is valid after ``resolve()``."""

    deferred = True

    @staticmethod
    def mark():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def elapsed(start, end) -> float:
        return start.elapsed_time(end) / 1000.0

    @staticmethod
    def resolve() -> None:
        torch.cuda.synchronize()


class StepTimeRecorder:
    """Accumulates the exclusive time of each part and the wall time of each step until ``take()``.

    Args:
        use_cuda_events: mark with CUDA events (default: when CUDA is available and initialised).
        marks: a mark source with ``mark()``, ``elapsed(a, b)`` (seconds), ``resolve()`` and
            ``deferred`` (tests substitute their own clock).
        skip_parts: parts not timed (their time stays in the enclosing part). Default: ``tp_comm``
            with CUDA events, where a section per tensor-parallel collective (several per layer and
            microbatch) would cost two event records each; none on the host clock.

    ``begin(part)``/``end(part)`` must nest; ``end`` of a part that is not open is ignored (a timer
    stopped twice must not break training). ``take()`` returns per-step averages in milliseconds.
    """

    def __init__(self, use_cuda_events: Optional[bool] = None, marks=None, skip_parts=None):
        if marks is None:
            if use_cuda_events is None:
                use_cuda_events = torch.cuda.is_available() and torch.cuda.is_initialized()
            marks = _CudaEventMarks if use_cuda_events else _HostMarks
        self._marks = marks
        if skip_parts is None:
            skip_parts = ("tp_comm",) if marks is _CudaEventMarks else ()
        self._skip = frozenset(skip_parts)
        self._stack: List[list] = []  # [part, start mark, children's elapsed (host) or child indices]
        self._totals: Dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self._pending: List[tuple] = []  # deferred clocks: (part, start, end, parent index or -1)
        self._step_start = None
        self._step_total = 0.0
        self._steps = 0

    # -- sections -------------------------------------------------------------------------------
    def begin(self, part: str) -> None:
        if self._step_start is None or part in self._skip:  # outside a step (evaluation, checkpoint): not a part
            return
        self._stack.append([part, self._marks.mark(), 0.0, len(self._pending)])
        if self._marks.deferred:
            self._pending.append(None)  # placeholder, filled at end()

    def end(self, part: str) -> None:
        for depth in range(len(self._stack) - 1, -1, -1):
            if self._stack[depth][0] == part:
                break
        else:
            return
        end_mark = self._marks.mark()
        while len(self._stack) > depth + 1:  # sections left open inside it end with it
            self._close(self._stack.pop(), end_mark)
        self._close(self._stack.pop(), end_mark)

    def _close(self, entry, end_mark) -> None:
        part, start, children, slot = entry
        if self._marks.deferred:
            parent = self._stack[-1][3] if self._stack else -1
            self._pending[slot] = (part, start, end_mark, parent)
            return
        elapsed = self._marks.elapsed(start, end_mark)
        self._totals[part] = self._totals.get(part, 0.0) + elapsed - children
        if self._stack:
            self._stack[-1][2] += elapsed

    @contextlib.contextmanager
    def section(self, part: str):
        self.begin(part)
        try:
            yield
        finally:
            self.end(part)

    # -- steps ----------------------------------------------------------------------------------
    def step_begin(self) -> None:
        self._step_start = self._marks.mark()

    def step_end(self) -> None:
        if self._step_start is None:
            return
        end = self._marks.mark()
        if self._marks.deferred:
            self._pending.append(("__step__", self._step_start, end, -1))
        else:
            self._step_total += self._marks.elapsed(self._step_start, end)
        self._step_start = None
        self._steps += 1

    def take(self) -> Dict[str, float]:
        """Per-step averages (ms) since the last ``take``: each part, ``other`` (step time no part
        covers) and ``total`` (the steps' wall time), plus ``steps``; then reset. With CUDA events
        this synchronizes the device once."""
        if self._marks.deferred:
            self._resolve_pending()
        steps = max(self._steps, 1)
        report = {part: self._totals.get(part, 0.0) * 1000.0 / steps for part in PARTS}
        report["total"] = self._step_total * 1000.0 / steps
        report["other"] = report["total"] - sum(report[part] for part in PARTS)
        report["steps"] = self._steps
        self._totals = dict.fromkeys(PARTS, 0.0)
        self._step_total, self._steps = 0.0, 0
        return report

    def _resolve_pending(self) -> None:
        done = [entry for entry in self._pending if entry is not None]
        if not done:
            return
        self._marks.resolve()
        elapsed = [0.0 if entry is None else self._marks.elapsed(entry[1], entry[2]) for entry in self._pending]
        children = [0.0] * len(self._pending)
        for index, entry in enumerate(self._pending):
            if entry is not None and entry[3] >= 0:
                children[entry[3]] += elapsed[index]
        for index, entry in enumerate(self._pending):
            if entry is None:
                continue
            if entry[0] == "__step__":
                self._step_total += elapsed[index]
            else:
                self._totals[entry[0]] = self._totals.get(entry[0], 0.0) + elapsed[index] - children[index]
        # Sections still open keep their slots (placeholders); closed ones are dropped.
        if self._stack:
            keep = {entry[3] for entry in self._stack}
            remap, kept = {}, []
            for index, entry in enumerate(self._pending):
                if index in keep:
                    remap[index] = len(kept)
                    kept.append(None)
            for entry in self._stack:
                entry[3] = remap[entry[3]]
            self._pending = kept
        else:
            self._pending = []


_RECORDER: Optional[StepTimeRecorder] = None


def install(recorder: Optional[StepTimeRecorder]) -> None:
    """Make ``recorder`` the one ``section()`` reports to (None: sections become free again)."""
    global _RECORDER
    _RECORDER = recorder


def uninstall() -> None:
    install(None)


def active_recorder() -> Optional[StepTimeRecorder]:
    return _RECORDER


def section(part: str):
    """Context manager charging the block to ``part`` of the active recorder; a shared no-op
    ``nullcontext`` when none is installed."""
    recorder = _RECORDER
    if recorder is None:
        return _NULL
    return recorder.section(part)
