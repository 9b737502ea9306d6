"""Old import path of the checkpoint integrity names (now megatron.training.checkpointing.integrity and its neighbours)."""
from megatron.training.checkpointing.durable import (
    exchange_paths,
    fsync_dir,
    fsync_tree,
    replace_dir,
    write_tracker,
)
from megatron.training.checkpointing.errors import (
    CheckpointIntegrityError,
    CheckpointTrackerError,
    FailedOnAnotherRankError,
    NotARegularFileError,
)
from megatron.training.checkpointing.integrity import (
    choose_checkpoint,
    prepare_save_dir,
    publish_iteration,
    recover_leftovers,
)
from megatron.training.checkpointing.layout import (
    MANIFEST_FILENAME,
    NON_PERSISTENT_SUBDIR,
    TRACKER_FILENAME,
    iteration_dirname,
)
from megatron.training.checkpointing.manifest import (
    MANIFEST_VERSION,
    digest_files,
    file_digest,
    manifest_entry_path,
    read_manifest,
    verify_directory,
    write_manifest,
)
from megatron.training.checkpointing.tracker import iterations_in, read_tracker, tracker_exists

__all__ = [
    "exchange_paths", "fsync_dir", "fsync_tree", "replace_dir", "write_tracker", "CheckpointIntegrityError",
    "CheckpointTrackerError", "FailedOnAnotherRankError", "NotARegularFileError", "choose_checkpoint",
    "prepare_save_dir", "publish_iteration", "recover_leftovers", "MANIFEST_FILENAME", "NON_PERSISTENT_SUBDIR",
    "TRACKER_FILENAME", "iteration_dirname", "MANIFEST_VERSION", "digest_files", "file_digest",
    "manifest_entry_path", "read_manifest", "verify_directory", "write_manifest", "iterations_in", "read_tracker",
    "tracker_exists",
]
