"""PretrainConfigContainer: every setting of a pretraining run, typed, built once from args (Megatron HEAD's name)."""
import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.telemetry.config import TelemetryConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.config.common_config import DistributedInitConfig, RNGConfig
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


@dataclass(kw_only=True)
class PretrainConfigContainer:
    """The run's configuration, one typed slice per concern.

    Built once by ``megatron.training.argument_utils.pretrain_cfg_container_from_args`` after
    ``validate_args``; read through ``megatron.training.global_vars.get_config()``. Internal training
    functions take the slice they need (``cfg.train``, ``cfg.logger``, ...). It is never pickled into a
    checkpoint: checkpoints keep storing the sanitized ``args`` Namespace, as Megatron-LM does.

    ``model``, ``optimizer`` and ``ddp`` are the core configs. Megatron's core configs themselves repeat
    a few settings (``fp16``, ``bf16`` and ``params_dtype`` in both ``model`` and ``optimizer``;
    ``use_distributed_optimizer`` in ``optimizer`` and ``ddp``); the builder sets each pair from the same flag.
    """

    train: TrainingConfig
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    model: TransformerConfig
    gpt: GPTModelProviderConfig = field(default_factory=GPTModelProviderConfig)
    optimizer: OptimizerConfig
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    ddp: DistributedDataParallelConfig = field(default_factory=DistributedDataParallelConfig)
    dist: DistributedInitConfig = field(default_factory=DistributedInitConfig)
    rng: RNGConfig = field(default_factory=RNGConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)

    def to_dict(self) -> dict:
        """``{slice: {field: value}}`` with plain JSON values: dtypes, functions, classes, signals and
        other objects become their ``str``; runtime callbacks (``timers``, ``*_func``) are ``None`` until set."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _plain(value: Any) -> Any:
    """``value`` as JSON-able data (recursing into dataclasses, sequences and dicts)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.name
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(v) for v in value]
        return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)  # torch.dtype, activation functions, span-group classes
