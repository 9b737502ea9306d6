"""Which failures of reading a checkpoint are the user's (a checkpoint or tracker that is missing, damaged,
unsafe, of another format or of another model) and their report as one line at the entry points.

pretrain_gpt.py, tools/run_text_generation.py and tools/checkpoint/* wrap their checkpoint reads in
:func:`checkpoint_errors_as_user_errors` (or test :func:`is_checkpoint_user_error`), so such a failure
ends the run with one ``error: ...`` line naming the file and no traceback; other failures keep theirs.
"""
import os
import pickle
from contextlib import contextmanager

from megatron.core.dist_checkpointing import safe_loading
from megatron.training import checkpoint_integrity
from megatron.training.user_errors import UserInputError

# Files whose own RuntimeErrors are written for users (they name the checkpoint file and what to do).
_LOADER_SOURCES = (
    os.path.dirname(os.path.abspath(safe_loading.__file__)) + os.sep,
    os.path.join(os.path.dirname(os.path.abspath(checkpoint_integrity.__file__)), "checkpointing.py"),
    os.path.abspath(checkpoint_integrity.__file__),
)


def _raised_by_loader(error: BaseException) -> bool:
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
    return any(filename == source or filename.startswith(source) for source in _LOADER_SOURCES)


def is_checkpoint_user_error(error: BaseException) -> bool:
    """Whether ``error``, raised while reading a checkpoint, is the checkpoint's (or its path's) fault.

    True for file-system errors (missing file or directory, no permission), ValueErrors (a malformed
    tracker, a mismatching model or layout, a checkpoint of the other format), refused or unreadable
    files (UnpicklingError, CheckpointReadError, CheckpointFileError, CheckpointIntegrityError) and
    RuntimeErrors raised by the checkpoint loaders themselves (missing optimizer or RNG state, a model
    that does not match); False for anything else (an internal error keeps its traceback).
    """
    if isinstance(error, (OSError, ValueError, pickle.UnpicklingError, safe_loading.CheckpointFileError,
                          checkpoint_integrity.CheckpointIntegrityError)):
        return True
    from megatron.training.checkpointing import CheckpointReadError  # checkpointing is heavy to import

    if isinstance(error, CheckpointReadError):
        return True
    return isinstance(error, RuntimeError) and _raised_by_loader(error)


def one_line(error: BaseException) -> str:
    """``str(error)`` on one line (torch's load_state_dict lists missing keys on several lines)."""
    return " ".join(part.strip() for part in str(error).splitlines() if part.strip())


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
