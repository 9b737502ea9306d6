"""Errors caused by the user's input (flags, environment, files): one line per failing rank, no traceback."""
import os
import sys


class UserInputError(ValueError):
    """A run cannot start or go on because of the user's input; the message says what to change.

    The entry point prints it as one ``error: ...`` line and exits with ``exit_status`` (2 for flag
    errors, as argparse does; 1 otherwise) instead of showing a traceback; any other exception is an
    internal error and keeps its traceback. A ``ValueError`` so callers that catch those still do.
    """

    def __init__(self, message: str, exit_status: int = 1):
        super().__init__(message)
        self.exit_status = exit_status


def error_line(error: BaseException) -> str:
    """``error: MESSAGE``, prefixed with ``[rank N]`` when several ranks run.

    Every failing rank prints its own line: the ranks cannot know that the others agree before the
    process group exists, and torchrun kills the remaining ranks as soon as one exits, so a rank that
    stayed silent for another could leave the user with no message at all.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    prefix = f"[rank {os.environ.get('RANK', '0')}] " if world_size > 1 else ""
    return f"{prefix}error: {error}"


def run_reporting_user_errors(main, *args, **kwargs):
    """Call ``main(*args, **kwargs)``; a ``UserInputError`` becomes one line on stderr and ``sys.exit``.

    Raises:
        SystemExit: with the error's ``exit_status`` after a ``UserInputError``.
    """
    try:
        return main(*args, **kwargs)
    except UserInputError as error:
        sys.stdout.flush()
        print(error_line(error), file=sys.stderr, flush=True)
        sys.exit(error.exit_status)
