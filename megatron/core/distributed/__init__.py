"""Data-parallel wrapper, its config, and the end-of-iteration grad reductions."""
from .distributed_data_parallel import DistributedDataParallel
from .distributed_data_parallel_config import DistributedDataParallelConfig
from .finalize_model_grads import finalize_model_grads
from .torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
from .torch_fully_sharded_data_parallel_config import TorchFullyShardedDataParallelConfig

__all__ = ["DistributedDataParallel", "DistributedDataParallelConfig", "finalize_model_grads",
           "TorchFullyShardedDataParallel", "TorchFullyShardedDataParallelConfig"]
