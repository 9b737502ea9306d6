"""The profiling settings of a run: Megatron-LM's --profile* and --record-memory-history flags, typed (Megatron-Bridge's name)."""
from dataclasses import dataclass, field
from typing import List, Optional


@dataclass(kw_only=True)
class ProfilingConfig:
    """Which iterations and ranks are profiled, and how (Megatron-LM core_v0.14's flags and defaults).

    ``profile``: profile iterations ``[profile_step_start, profile_step_end)`` (1-based, as in the log
    line) on the global ranks ``profile_ranks``; with ``use_pytorch_profiler`` a ``torch.profiler`` trace
    goes under ``tensorboard_dir`` (the logger's ``--tensorboard-dir``), else the CUDA profiler range
    (``cudaProfilerStart``/``Stop``, for ``nsys --capture-range=cudaProfilerApi``) is opened.
    ``record_memory_history``: CUDA allocator history recorded from model build on, and its snapshot
    pickled to ``memory_snapshot_path`` by the last rank every log interval (and on an out-of-memory error).
    """

    profile: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: List[int] = field(default_factory=lambda: [0])
    use_pytorch_profiler: bool = False
    record_memory_history: bool = False
    memory_snapshot_path: str = "snapshot.pickle"

    def validate(self, tensorboard_dir: Optional[str] = None, world_size: Optional[int] = None) -> None:
        """ValueError, in one line naming the flag, for settings Megatron-LM would fail on later (a trace
        with no directory, an empty step range) or that would silently profile nothing (a rank outside
        the job)."""
        if not self.profile:
            return
        if self.profile_step_start < 0:
            raise ValueError(f"--profile-step-start must be >= 0 (got {self.profile_step_start})")
        if self.profile_step_end <= self.profile_step_start:
            raise ValueError(f"--profile-step-end ({self.profile_step_end}) must be greater than "
                             f"--profile-step-start ({self.profile_step_start}): the profiled iterations are "
                             "[start, end)")
        if self.use_pytorch_profiler and not tensorboard_dir:
            raise ValueError("--use-pytorch-profiler writes its trace under --tensorboard-dir: set --tensorboard-dir")
        if world_size is not None:
            outside = [rank for rank in self.profile_ranks if not 0 <= rank < world_size]
            if outside:
                raise ValueError(f"--profile-ranks {' '.join(map(str, outside))}: not a rank of this job "
                                 f"(world size {world_size})")
