"""Typed configuration of a training run (Megatron-LM HEAD's megatron/training/config package)."""
from megatron.training.config.common_config import DistributedInitConfig, RNGConfig
from megatron.training.config.container import PretrainConfigContainer
from megatron.training.config.data_config import DataConfig
from megatron.training.config.model_config import GPTModelProviderConfig
from megatron.training.config.profiling_config import ProfilingConfig
from megatron.training.config.training_config import (
    CheckpointConfig,
    LoggerConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
    ValidationConfig,
)

__all__ = [
    "CheckpointConfig", "DataConfig", "DistributedInitConfig", "GPTModelProviderConfig", "LoggerConfig",
    "PretrainConfigContainer", "ProfilingConfig", "RNGConfig", "SchedulerConfig", "TokenizerConfig", "TrainingConfig",
    "ValidationConfig",
]
