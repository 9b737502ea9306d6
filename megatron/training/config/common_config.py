"""Settings shared by every run kind: random seeds and the distributed launch (Megatron-LM HEAD's common_config.py)."""
from dataclasses import dataclass
from typing import Optional


@dataclass(kw_only=True)
class RNGConfig:
    """Random seed of python, numpy and torch, and whether data-parallel replicas start differently."""

    seed: int = 1234
    data_parallel_random_init: bool = False


@dataclass(kw_only=True)
class DistributedInitConfig:
    """The launch: backend, timeout, this process's place (from the launcher's environment) and the
    data-parallel size ``validate_args`` derives (world size / (tp x pp x cp))."""

    distributed_backend: str = "gloo"
    distributed_timeout_minutes: int = 10
    local_rank: int = 0
    use_tp_pp_dp_mapping: bool = False
    rank: int = 0
    world_size: int = 1
    data_parallel_size: Optional[int] = None
