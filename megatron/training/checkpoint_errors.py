"""Old import path of megatron.training.checkpointing.errors (every checkpoint error, and which are the user's)."""
from megatron.training.checkpointing.errors import (
    CheckpointContentError,
    checkpoint_errors_as_user_errors,
    is_checkpoint_user_error,
    one_line,
)

__all__ = ["CheckpointContentError", "checkpoint_errors_as_user_errors", "is_checkpoint_user_error", "one_line"]
