"""ModelParallelConfig: the parallelism and precision settings shared by every Megatron core module."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass
class ModelParallelConfig:
    """Parallelism, precision and pipeline-communication settings (field names are Megatron-LM's).

    Training builds it from parsed args by copying same-named attributes.
    ``sequence_parallel`` is disabled with a warning when ``tensor_model_parallel_size`` is 1
    (what Megatron's argument validation does). ``pipeline_dtype`` defaults to ``params_dtype``.

    Raises ValueError for non-positive parallel sizes, for ``fp16`` and ``bf16`` together, and for a
    virtual pipeline size without pipeline parallelism.
    """

    # Model parallelism
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    # Tensor-parallel size inside expert layers; None means tensor_model_parallel_size (Megatron's default).
    expert_tensor_parallel_size: Optional[int] = None

    # Initialisation
    perform_initialization: bool = True
    use_cpu_initialization: bool = False

    # Precision
    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32

    # --deterministic-mode: the training driver turns torch's deterministic algorithms on at start-up
    # (Megatron-LM keeps the flag here too).
    deterministic_mode: bool = False

    # Training hooks (set by the training loop / DDP wrapper)
    timers: Optional[Callable] = None
    finalize_model_grads_func: Optional[Callable] = None
    grad_scale_func: Optional[Callable] = None
    no_sync_func: Optional[Callable] = None
    grad_sync_func: Optional[Callable] = None
    param_sync_func: Optional[Callable] = None

    # Pipeline parallel communication
    pipeline_dtype: Optional[torch.dtype] = None
    variable_seq_lengths: bool = False
    calculate_per_token_loss: bool = False
    gradient_accumulation_fusion: bool = False
    deallocate_pipeline_outputs: bool = False
    barrier_with_L1_time: bool = True
    batch_p2p_comm: bool = True
    overlap_p2p_comm: bool = False

    def __post_init__(self):
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size", "expert_model_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        elif not isinstance(self.expert_tensor_parallel_size, int) or self.expert_tensor_parallel_size < 1:
            raise ValueError(
                f"expert_tensor_parallel_size must be a positive integer, got {self.expert_tensor_parallel_size!r}")
        if self.fp16 and self.bf16:
            raise ValueError("fp16 and bf16 cannot both be True")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            warnings.warn("sequence_parallel is disabled because tensor_model_parallel_size is 1")
            self.sequence_parallel = False
        if self.virtual_pipeline_model_parallel_size is not None and self.pipeline_model_parallel_size <= 1:
            raise ValueError(
                "pipeline-model-parallel size should be greater than 1 with interleaved schedule "
                f"(virtual_pipeline_model_parallel_size={self.virtual_pipeline_model_parallel_size}, "
                f"pipeline_model_parallel_size={self.pipeline_model_parallel_size})"
            )
        if self.pipeline_dtype is None:
            self.pipeline_dtype = self.params_dtype
