"""Console lines that stay whole when several ranks share one stdout or stderr: each goes out in one write call."""
import sys
from typing import Optional, TextIO


def write_line(text: str, file: Optional[TextIO] = None) -> None:
    """Write ``text`` and a newline to ``file`` (default: the current ``sys.stdout``) in one ``write``
    call, then flush.

    ``print(text)`` writes the text and the newline in two calls. With unbuffered output
    (``PYTHONUNBUFFERED=1``, ``python -u``) each call is its own system call, so when the ranks that
    torchrun starts share one pipe or file, another rank's line can land between this rank's text and
    its newline, and two lines merge into one. One call keeps a line whole: a pipe write of up to
    PIPE_BUF (4096) bytes is atomic, and writes to one open file do not interleave. Output buffered
    earlier is flushed first, so the line goes out in a write of its own. ``text`` may hold several
    lines; they go out together. Nothing is written when the stream is ``None`` (no console).
    """
    stream = sys.stdout if file is None else file
    if stream is None:
        return
    stream.flush()
    stream.write(f"{text}\n")
    stream.flush()
