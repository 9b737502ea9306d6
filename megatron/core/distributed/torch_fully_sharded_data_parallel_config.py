"""Configuration of the FSDP2 wrapper (Megatron-LM core_v0.14's TorchFullyShardedDataParallelConfig)."""
from dataclasses import dataclass

from .distributed_data_parallel_config import DistributedDataParallelConfig


@dataclass
class TorchFullyShardedDataParallelConfig(DistributedDataParallelConfig):
    """Options of :class:`TorchFullyShardedDataParallel` (``--use-torch-fsdp2``).

    The inherited fields keep their data-parallel meaning where FSDP2 has one: ``overlap_grad_reduce``
    and ``overlap_param_gather`` turn on explicit backward / forward prefetching of the next unit's
    all-gather; ``grad_reduce_in_fp32`` reduce-scatters in fp32 (always so under bf16). Bucketing and
    ``average_in_collective`` do not apply (FSDP2 reduces one unit at a time and averages).

    Attributes:
        reshard_after_forward: free each unit's gathered parameters after its forward and gather them
            again in backward (``--torch-fsdp2-no-reshard-after-forward`` keeps them: ZeRO-2 style).
    """

    reshard_after_forward: bool = True

    def __post_init__(self):
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(f"--ddp-bucket-size must be positive, got {self.bucket_size}")
        if self.use_distributed_optimizer:
            raise ValueError("--use-torch-fsdp2 and --use-distributed-optimizer are mutually exclusive: FSDP2 "
                             "shards the optimizer state itself")
