"""Errors caused by the user's input (flags, environment, files): one line, no traceback."""
import os
import sys
import time

from megatron.core.console import write_line
from megatron.core.process_groups_config import ParallelConfigMismatchError

# How long a rank that leaves the message to rank 0 waits before exiting under a launcher that stops
# the other ranks as soon as one exits (torchrun; srun with --kill-on-bad-exit): rank 0 must have
# printed by then.
_SILENT_RANK_GRACE_S = 10.0


def _launcher_stops_other_ranks() -> bool:
    # torchrun's agent sets TORCHELASTIC_RUN_ID in every worker; srun sets SLURM_STEP_ID in every task.
    return "TORCHELASTIC_RUN_ID" in os.environ or "SLURM_STEP_ID" in os.environ


class UserInputError(ValueError):
    """A run cannot start or go on because of the user's input; the message says what to change.

    The entry point prints it as one ``error: ...`` line and exits with ``exit_status`` (2 for flag
    errors, as argparse does; 1 otherwise) instead of showing a traceback; any other exception is an
    internal error and keeps its traceback. A ``ValueError`` so callers that catch those still do.

    ``same_on_every_rank`` marks errors that every rank necessarily raises alike (the flags are the
    same on every rank): then only rank 0 prints the line.
    """

    def __init__(self, message: str, exit_status: int = 1, same_on_every_rank: bool = False):
        super().__init__(message)
        self.exit_status = exit_status
        self.same_on_every_rank = same_on_every_rank


def one_line(error: BaseException) -> str:
    """``str(error)`` on one line (torch's load_state_dict, for one, lists missing keys on several lines)."""
    return " ".join(part.strip() for part in str(error).splitlines() if part.strip())


def error_line(error: BaseException) -> str:
    """``error: MESSAGE``, prefixed with ``[rank N]`` when several ranks run and the error may differ
    per rank (a file missing on one node, say); an error every rank raises alike is printed by
    rank 0 alone, without the prefix."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    alike = getattr(error, "same_on_every_rank", False)
    prefix = f"[rank {os.environ.get('RANK', '0')}] " if world_size > 1 and not alike else ""
    return f"{prefix}error: {one_line(error)}"


def _leaves_message_to_rank_0(error: BaseException) -> bool:
    return (getattr(error, "same_on_every_rank", False) and int(os.environ.get("WORLD_SIZE", "1")) > 1
            and os.environ.get("RANK", "0") != "0")


# Errors printed as one line: the user's input, and core's user-facing configuration errors (core
# cannot derive from UserInputError, which lives above it; they carry the same two attributes).
REPORTED_AS_ONE_LINE = (UserInputError, ParallelConfigMismatchError)


def report_and_exit(error: UserInputError):
    """Print ``error`` as one line (once, by rank 0, when every rank raises it alike) and exit.

    Raises:
        SystemExit: always, with the error's ``exit_status``.
    """
    sys.stdout.flush()
    if _leaves_message_to_rank_0(error):
        # Rank 0 raises the same error and prints it; exiting at once could get rank 0 stopped
        # by the launcher before it has printed.
        if _launcher_stops_other_ranks():
            time.sleep(_SILENT_RANK_GRACE_S)
    else:
        write_line(error_line(error), file=sys.stderr)
    sys.exit(error.exit_status)


def run_reporting_user_errors(main, *args, **kwargs):
    """Call ``main(*args, **kwargs)``; a ``UserInputError`` (or another of ``REPORTED_AS_ONE_LINE``, e.g. a
    model whose config disagrees with its process groups) becomes one line on stderr and ``sys.exit``.

    Raises:
        SystemExit: with the error's ``exit_status`` after one of ``REPORTED_AS_ONE_LINE``.
    """
    try:
        return main(*args, **kwargs)
    except REPORTED_AS_ONE_LINE as error:
        report_and_exit(error)
