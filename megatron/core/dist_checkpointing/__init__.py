"""Sharded, reshardable checkpoints (``--ckpt-format torch_dist``) on torch.distributed.checkpoint.

``mapping``: a rank's chunk of a global tensor (:class:`ShardedTensor`) and the tensor-parallel
layouts; ``model_and_optimizer``: the sharded state of a GPT model and its optimizer under
Megatron-LM core_v0.14's keys (docs/megatron-checkpoints.md); ``serialization``: save/load of
sharded tensors with DCP planners plus Megatron's ``metadata.json``; ``safe_loading``: reads of
``.metadata`` and data files that run no code a crafted checkpoint holds.
"""
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, TPLayout
from megatron.core.dist_checkpointing.serialization import CheckpointMismatchError, is_dcp_checkpoint, load, save

__all__ = ["ShardedObject", "ShardedTensor", "TPLayout", "CheckpointMismatchError", "is_dcp_checkpoint", "load", "save"]
