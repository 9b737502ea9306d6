"""Save and load checkpoints atomically: ``torch_dist`` (sharded, reshardable; megatron.core.dist_checkpointing)
and Megatron-LM's legacy ``torch`` format (one file per (tp, pp) rank). Megatron's entry points, re-exported.

The package's modules, each one job (docs/ARCHITECTURE.md):

``layout``      every on-disk name, the one format detector, the parallel-layout record, ``common.pt``, rank order
``state``       what goes into a checkpoint: the per-rank state dict, sanitized args, RNG states, saved-args checks
``torch_format`` / ``dist_format``  the two formats; ``legacy_optimizer_state`` Megatron's positional optimizer state
``saving`` / ``loading``  save_checkpoint (and the pending ``--async-save``), load_checkpoint
``async_save``  the ``--async-save`` background writer
``durable``     write, fsync, publish by rename, behind one storage seam (``set_storage``) fault tests replace
``tracker`` / ``manifest`` / ``integrity``  the tracker file, the integrity manifest, crash-safe publish and choice
``errors``      every checkpoint error (all CheckpointingException) and which are the user's
``collectives`` the small collectives of a save or load
"""
from megatron.core.dist_checkpointing.safe_loading import CheckpointReadError, load_torch_file
from megatron.training.checkpointing import collectives, saving
from megatron.training.checkpointing.durable import write_durably, write_failure
from megatron.training.checkpointing.errors import CheckpointSaveError, CheckpointWriteError
from megatron.training.checkpointing.layout import (
    CHECKPOINT_BASENAME,
    CHECKPOINT_VERSION,
    CKPT_FORMATS,
    COMMON_BASENAME,
    DISTRIBUTED_OPTIMIZER_BASENAME,
    RNG_DIRNAME,
    TRACKER_FILENAME,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
    get_distributed_optimizer_checkpoint_name,
)
from megatron.training.checkpointing.layout import detect_format as detect_checkpoint_format
from megatron.training.checkpointing.loading import load_checkpoint
from megatron.training.checkpointing.saving import (
    async_save_pending,
    finalize_async_save,
    non_persistent_checkpoint_dir,
    save_checkpoint,
    wait_for_async_staging,
)
from megatron.training.checkpointing.state import (
    MODEL_SHAPE_ARGS,
    check_checkpoint_args,
    generate_state_dict,
    get_checkpoint_version,
    get_rng_state,
    sanitized_args,
    saved_args,
    set_checkpoint_version,
    warn_if_vocab_padding_differs,
)
from megatron.training.checkpointing.tracker import read_metadata

# Megatron-LM's name of core's one torch.load of a checkpoint file.
load_state_dict_file = load_torch_file
# Former private names still used by this repository's tools, tests and benchmarks until they move to the
# public ones (durable.write_durably, state.sanitized_args, collectives.*, saving._PENDING).
_write_durably = write_durably
_sanitized_args = sanitized_args
_any_rank = collectives.any_rank
_broadcast_int_from_rank_0 = collectives.broadcast_int_from_rank_0
_PENDING = saving._PENDING  # the same list: pending --async-save writers

__all__ = [
    "CHECKPOINT_VERSION", "get_checkpoint_name", "get_checkpoint_tracker_filename", "read_metadata",
    "get_rng_state", "generate_state_dict", "save_checkpoint", "get_distributed_optimizer_checkpoint_name",
    "load_checkpoint", "load_state_dict_file", "finalize_async_save", "async_save_pending",
    "wait_for_async_staging", "detect_checkpoint_format",
    "CheckpointReadError", "check_checkpoint_args", "saved_args", "MODEL_SHAPE_ARGS",
    "CheckpointWriteError", "CheckpointSaveError", "write_failure", "get_checkpoint_version", "set_checkpoint_version",
    "TRACKER_FILENAME", "CHECKPOINT_BASENAME", "DISTRIBUTED_OPTIMIZER_BASENAME", "COMMON_BASENAME", "RNG_DIRNAME",
    "CKPT_FORMATS", "non_persistent_checkpoint_dir", "warn_if_vocab_padding_differs", "sanitized_args",
    "write_durably",
]
