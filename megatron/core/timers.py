"""Named wall-clock timers with log levels, reduced across ranks and printed in Megatron's format."""
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron.core import step_timing
from megatron.core.collective_device import get_collective_device
from megatron.core.console import write_line


def _synchronize():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Timer:
    """Accumulates elapsed seconds between start() and stop() calls.

    ``barrier=True`` waits for every rank first, so the time measures the slowest rank's work.
    Raises RuntimeError on start() of a running timer or stop() of a stopped one.
    """

    def __init__(self, name: str):
        self.name = name
        self._elapsed = 0.0
        self._active_total = 0.0
        self._started = False
        self._start_time = 0.0

    def start(self, barrier: bool = False):
        if self._started:
            raise RuntimeError(f"timer {self.name!r} has already been started")
        if barrier and dist.is_initialized():
            dist.barrier()
        _synchronize()
        self._start_time = time.perf_counter()
        self._started = True

    def stop(self, barrier: bool = False):
        if not self._started:
            raise RuntimeError(f"timer {self.name!r} is not started")
        if barrier and dist.is_initialized():
            dist.barrier()
        _synchronize()
        delta = time.perf_counter() - self._start_time
        self._elapsed += delta
        self._active_total += delta
        self._started = False

    def reset(self):
        self._elapsed = 0.0
        self._started = False

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        """Seconds accumulated since the last reset (a running timer is read without stopping it)."""
        was_running = self._started
        if was_running:
            self.stop(barrier=barrier)
        value = self._elapsed
        if reset:
            self.reset()
        if was_running:
            self.start(barrier=barrier)
        return value

    def active_time(self) -> float:
        """Seconds accumulated over the timer's whole life (never reset)."""
        return self._active_total


class _DummyTimer:
    """Stands in for timers above the configured log level: every call is a no-op."""

    def start(self, barrier: bool = False):
        pass

    def stop(self, barrier: bool = False):
        pass

    def reset(self):
        pass

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        return 0.0

    def active_time(self) -> float:
        return 0.0


class _PartTimer:
    """A timer that also opens/closes its part of the step-time breakdown (whatever its log level)."""

    __slots__ = ("_timer", "_part")

    def __init__(self, timer, part: str):
        self._timer, self._part = timer, part

    def start(self, barrier: bool = False):
        self._timer.start(barrier=barrier)  # a barrier wait is not the part's own time
        recorder = step_timing.active_recorder()
        if recorder is not None:
            recorder.begin(self._part)

    def stop(self, barrier: bool = False):
        recorder = step_timing.active_recorder()
        if recorder is not None:
            recorder.end(self._part)
        self._timer.stop(barrier=barrier)

    def __getattr__(self, name):
        return getattr(self._timer, name)


class Timers:
    """Registry of timers. ``timers(name, log_level)`` returns the timer (a no-op one above ``log_level``).

    Args:
        log_level: 0, 1 or 2 (``--timing-log-level``); a timer whose level exceeds it is not measured.
        log_option: ``minmax`` (default), ``max`` or ``all`` (``--timing-log-option``).
    """

    def __init__(self, log_level: int = 0, log_option: str = "minmax"):
        if log_option not in ("minmax", "max", "all"):
            raise ValueError(f"--timing-log-option must be minmax, max or all, got {log_option!r}")
        self._log_level = log_level
        self._log_option = log_option
        self._timers: Dict[str, Timer] = {}
        self._levels: Dict[str, int] = {}
        self._dummy = _DummyTimer()

    def __call__(self, name: str, log_level: Optional[int] = None):
        timer = self._get(name, log_level)
        part = step_timing.TIMER_PARTS.get(name)
        if part is not None and step_timing.active_recorder() is not None:
            return _PartTimer(timer, part)  # also charges the step-time breakdown (step_timing.py)
        return timer

    def _get(self, name: str, log_level: Optional[int]):
        if name in self._timers:
            if log_level is not None and log_level != self._levels[name]:
                raise ValueError(f"timer {name!r} was created with log level {self._levels[name]}, not {log_level}")
            return self._timers[name]
        level = 2 if log_level is None else log_level
        if level > self._log_level:
            return self._dummy
        self._timers[name] = Timer(name)
        self._levels[name] = level
        return self._timers[name]

    def _gather_ms(self, names: List[str], reset: bool, barrier: bool) -> torch.Tensor:
        """[world, len(names)] elapsed milliseconds (0 where a rank lacks the timer), on the CPU.

        The gather runs on the device the default group's backend needs (CUDA under NCCL).
        """
        if barrier and dist.is_initialized():
            dist.barrier()
        local = torch.tensor(
            [self._timers[n].elapsed(reset=reset) * 1000.0 if n in self._timers else 0.0 for n in names],
            dtype=torch.float64, device=get_collective_device(),
        )
        if not dist.is_initialized():
            return local.unsqueeze(0).cpu()
        gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        return torch.stack(gathered).cpu()

    def get_all_timers_string(self, names: List[str], normalizer: float = 1.0, reset: bool = True,
                              barrier: bool = False) -> Optional[str]:
        """Collective over all ranks: the report string, or None when no named timer ran.

        When none of ``names`` exists on this rank (all of them above ``--timing-log-level``, the
        usual case of the per-iteration log line at level 0) there is nothing to gather: None at
        once, without the all-gather and its host read. Every rank has the same timers for the same
        names at a given log level, so all of them skip (or gather) together.
        """
        if normalizer <= 0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        if not any(name in self._timers for name in names):
            return None
        times = self._gather_ms(names, reset, barrier) / normalizer
        lines = []
        for i, name in enumerate(names):
            column = times[:, i]
            ran = column[column > 0]
            if ran.numel() == 0:
                continue
            label = "    " + (name + " ").ljust(48, ".")
            if self._log_option == "minmax":
                lines.append(f"{label}: ({ran.min().item():.2f}, {ran.max().item():.2f})")
            elif self._log_option == "max":
                lines.append(f"{label}: {ran.max().item():.2f}")
            else:
                lines.append(f"{label}: " + ", ".join(f"{v:.2f}" for v in column.tolist()))
        if not lines:
            return None
        header = {
            "minmax": "(min, max) time across ranks (ms):",
            "max": "max time across ranks (ms):",
            "all": "times across ranks (ms):",
        }[self._log_option]
        return "\n".join([header] + lines)

    def log(self, names: List[str], rank: Optional[int] = None, normalizer: float = 1.0, reset: bool = True,
            barrier: bool = False):
        """Collective: print the timers' report on ``rank`` (default: the last rank)."""
        text = self.get_all_timers_string(names, normalizer, reset, barrier)
        if rank is None:
            rank = dist.get_world_size() - 1 if dist.is_initialized() else 0
        my_rank = dist.get_rank() if dist.is_initialized() else 0
        if text is not None and my_rank == rank:
            write_line(text)

    def write(self, names: List[str], writer, iteration: int, normalizer: float = 1.0, reset: bool = False):
        """Add ``<name>-time`` scalars (max over ranks would need a collective; this writes local times)."""
        for name in names:
            if name in self._timers:
                value = self._timers[name].elapsed(reset=reset) / normalizer
                writer.add_scalar(name + "-time", value, iteration)
