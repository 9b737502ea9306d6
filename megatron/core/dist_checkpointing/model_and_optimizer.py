"""The sharded state of a GPT model and its optimizer under Megatron-LM core_v0.14's torch_dist keys (import path kept).

The GPT key layout and the model's sharded state are in :mod:`megatron.core.models.gpt.checkpoint_keys`,
the optimizer's sharded and common state in :mod:`megatron.core.dist_checkpointing.optimizer`; this
module re-exports every name it had before the split (the private ones too: tests and tools use some).
New code imports from those two modules.
"""
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    TPLayout,
)
from megatron.core.dist_checkpointing.optimizer import (
    MAIN_PARAM,
    DISTRIB_OPTIM_SHARDING_TYPE,
    CONTENT_METADATA_KEY,
    _is_distributed,
    _model_params_of_main,
    _state_tensors,
    _Target,
    _optimizer_targets,
    optimizer_key,
    _plain,
    _fragments,
    flattened_shape,
    _flattened,
    _plain_shape,
    _fragment_shapes,
    _reassembled,
    optimizer_sharded_state,
    optimizer_load_plan,
    ensure_optimizer_state,
    _group_steps,
    optimizer_common_state,
    content_metadata,
    saved_groups_and_steps,
    _group_order,
    saved_grad_scaler,
    load_optimizer_common_state,
    unflatten_fragments,
)
from megatron.core.models.gpt.checkpoint_keys import (
    VOCAB_KEYS,
    OPTIMIZER_PREFIX,
    LAYER_PREFIX,
    _LAYER,
    _NORM_NAMES,
    checkpoint_layer_name,
    module_layer_name,
    is_per_layer_layout,
    per_layer_keys,
    model_uses_per_layer_keys,
    EXPERTS_PREFIX,
    leading_axes,
    extra_state_object,
    _unwrap,
    _layer_numbers,
    _num_layers,
    EntryKey,
    entry_key,
    _layout,
    ParamInfo,
    param_keys_and_layouts,
    stack_layer_axis,
    _model_key,
    extra_state_bytes,
    rng_state_object,
    model_sharded_state,
    stack_layers,
    unstack_layers,
)

# The name the layer-axis helper had here before the split.
_stack = stack_layer_axis

__all__ = [
    "ShardedObject", "ShardedTensor", "TPLayout", "VOCAB_KEYS", "OPTIMIZER_PREFIX", "LAYER_PREFIX", "_LAYER",
    "_NORM_NAMES", "checkpoint_layer_name", "module_layer_name", "is_per_layer_layout", "per_layer_keys",
    "model_uses_per_layer_keys", "EXPERTS_PREFIX", "leading_axes", "extra_state_object", "_unwrap",
    "_layer_numbers", "_num_layers", "EntryKey", "entry_key", "_layout", "ParamInfo",
    "param_keys_and_layouts", "stack_layer_axis", "_model_key", "extra_state_bytes", "rng_state_object",
    "model_sharded_state", "stack_layers", "unstack_layers", "_stack", "MAIN_PARAM",
    "DISTRIB_OPTIM_SHARDING_TYPE", "CONTENT_METADATA_KEY", "_is_distributed", "_model_params_of_main",
    "_state_tensors", "_Target", "_optimizer_targets", "optimizer_key", "_plain", "_fragments",
    "flattened_shape", "_flattened", "_plain_shape", "_fragment_shapes", "_reassembled",
    "optimizer_sharded_state", "optimizer_load_plan", "ensure_optimizer_state", "_group_steps",
    "optimizer_common_state", "content_metadata", "saved_groups_and_steps", "_group_order",
    "saved_grad_scaler", "load_optimizer_common_state", "unflatten_fragments",
]
