"""Tensor-parallel layers, autograd collectives, vocab-parallel cross entropy and the RNG tracker."""
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_tensor_model_parallel_attributes,
    linear_with_grad_accumulation_and_async_allreduce,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import (
    CheckpointFunction,
    CudaRNGStatesTracker,
    checkpoint,
    cuda_generator_state,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    model_init_rng,
    model_parallel_cuda_manual_seed,
    seeded_cuda_rng_states,
    set_model_init_seed,
)
from megatron.core.tensor_parallel.utils import VocabUtility, divide, split_tensor_along_last_dim

__all__ = [
    "vocab_parallel_cross_entropy",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "copy_tensor_model_parallel_attributes", "linear_with_grad_accumulation_and_async_allreduce",
    "param_is_not_tensor_parallel_duplicate", "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "copy_to_tensor_model_parallel_region", "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "CheckpointFunction", "CudaRNGStatesTracker", "checkpoint", "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name", "get_expert_parallel_rng_tracker_name", "model_parallel_cuda_manual_seed",
    "model_init_rng", "set_model_init_seed", "cuda_generator_state", "seeded_cuda_rng_states",
    "VocabUtility", "divide", "split_tensor_along_last_dim",
]
