"""Every checkpoint error, each derived from core's CheckpointingException (and keeping its former base), and which are the user's.

pretrain_gpt.py, tools/run_text_generation.py and tools/checkpoint/* wrap their checkpoint reads in
:func:`checkpoint_errors_as_user_errors` (or test :func:`is_checkpoint_user_error`), so a checkpoint or
tracker that is missing, damaged, unsafe, of another format or of another model ends the run with one
``error: ...`` line naming the file and no traceback; any other failure (a bug) keeps its traceback.
"""
from contextlib import contextmanager

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.safe_loading import (
    CheckpointFileError,
    CheckpointReadError,
    UnsafeCheckpointError,
)
from megatron.core.dist_checkpointing.serialization import CheckpointMismatchError, SaveFailedOnAnotherRankError
from megatron.training.user_errors import UserInputError, one_line

__all__ = [
    "CheckpointingException", "CheckpointFileError", "CheckpointReadError", "UnsafeCheckpointError",
    "CheckpointMismatchError", "SaveFailedOnAnotherRankError", "CheckpointContentError", "CheckpointWriteError",
    "CheckpointSaveError", "CheckpointIntegrityError", "FailedOnAnotherRankError", "NotARegularFileError",
    "CheckpointTrackerError", "is_checkpoint_user_error", "checkpoint_errors_as_user_errors", "one_line",
]


class CheckpointContentError(CheckpointingException, RuntimeError):
    """A checkpoint that reads but does not hold what this run needs: an entry, the optimizer, RNG or
    scheduler state missing, or a model state that does not fit. The message names the file and the
    flag that skips the part (``--no-load-optim``, ``--no-load-rng``, ...)."""


class CheckpointWriteError(CheckpointingException, OSError):
    """A checkpoint file or directory that could not be written: the message names it and the cause.

    ``errno`` is the failed call's (ENOSPC, EFBIG, EACCES...), ``path`` the file or directory.
    """

    def __init__(self, message, error_number=None, path=None):
        super().__init__(message)
        self.errno, self.path = error_number, path

    def __str__(self):
        return self.args[0]


class CheckpointSaveError(CheckpointWriteError):
    """A save that failed on this rank (a file that could not be written, named with the cause) or on
    another rank (named); the previous checkpoint and tracker were left unchanged. The entry points
    report it as one line (training.checkpoint_save_errors_as_user_errors)."""


class CheckpointIntegrityError(CheckpointingException, RuntimeError):
    """A checkpoint iteration directory that is missing, incomplete or whose files do not match its manifest."""


class FailedOnAnotherRankError(CheckpointingException, RuntimeError):
    """A checkpoint step that failed on another rank (this rank's message names it; that rank reports its own)."""


class NotARegularFileError(CheckpointingException, OSError):
    """A path that names something else than a regular file (a FIFO, device, directory, socket)."""


class CheckpointTrackerError(CheckpointingException, ValueError):
    """A ``latest_checkpointed_iteration.txt`` that holds neither a positive iteration nor ``release``."""


def is_checkpoint_user_error(error: BaseException) -> bool:
    """Whether ``error``, raised while reading a checkpoint, is the checkpoint's (or its path's) fault.

    True for every CheckpointingException (a malformed tracker, a mismatching model, layout or format, refused
    or unreadable files, missing parts, another rank's failure: that rank reports its own), file-system
    errors (OSError: missing file or directory, no permission) and UserInputErrors (already reported as
    the user's); False for anything else: an internal error, a plain ValueError or torch's own RuntimeErrors
    included, keeps its traceback.
    """
    return isinstance(error, (CheckpointingException, OSError, UserInputError))


@contextmanager
def checkpoint_errors_as_user_errors():
    """Turn a checkpoint failure (:func:`is_checkpoint_user_error`) raised inside into a UserInputError
    (exit status 1) with the same message on one line; other exceptions pass unchanged."""
    try:
        yield
    except UserInputError:
        raise
    except Exception as error:
        if not is_checkpoint_user_error(error):
            raise
        raise UserInputError(one_line(error)) from error
