"""Which failures of reading a checkpoint are the user's (a checkpoint or tracker that is missing, damaged,
unsafe, of another format or of another model) and their report as one line at the entry points.

pretrain_gpt.py, tools/run_text_generation.py and tools/checkpoint/* wrap their checkpoint reads in
:func:`checkpoint_errors_as_user_errors` (or test :func:`is_checkpoint_user_error`), so such a failure
ends the run with one ``error: ...`` line naming the file and no traceback; other failures keep theirs.
"""
import pickle
from contextlib import contextmanager

from megatron.core.dist_checkpointing import safe_loading
from megatron.training import checkpoint_integrity
from megatron.training.user_errors import UserInputError, one_line

__all__ = ["CheckpointContentError", "checkpoint_errors_as_user_errors", "is_checkpoint_user_error", "one_line"]


class CheckpointContentError(RuntimeError):
    """A checkpoint that reads but does not hold what this run needs: an entry, the optimizer, RNG or
    scheduler state missing, or a model state that does not fit. The message names the file and the
    flag that skips the part (``--no-load-optim``, ``--no-load-rng``, ...)."""


def is_checkpoint_user_error(error: BaseException) -> bool:
    """Whether ``error``, raised while reading a checkpoint, is the checkpoint's (or its path's) fault.

    True for file-system errors (missing file or directory, no permission), ValueErrors (a malformed
    tracker, a mismatching model or layout, a checkpoint of the other format), refused or unreadable
    files (UnpicklingError, CheckpointFileError, CheckpointIntegrityError), CheckpointContentError, and
    another rank's failure (FailedOnAnotherRankError: that rank reports its own);
    False for anything else (an internal error, torch's own RuntimeErrors included, keeps its traceback).
    """
    return isinstance(error, (OSError, ValueError, pickle.UnpicklingError, safe_loading.CheckpointFileError,
                              checkpoint_integrity.CheckpointIntegrityError,
                              checkpoint_integrity.FailedOnAnotherRankError, CheckpointContentError))


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
