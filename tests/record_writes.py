"""Run ``python SCRIPT ARGS...`` in this process and record every ``write`` call it makes on sys.stdout and
sys.stderr (a test launcher wrapper): each call appends ``[stream name, text]`` as one JSON line to
``DIR/writes_rank$RANK.jsonl`` at once, so a rank that is killed leaves its calls so far. The calls still
reach the real streams, and the script's exit status is passed on."""
import json
import os
import runpy
import sys
from pathlib import Path


class _RecordingStream:
    """A text stream that records each ``write`` call's text in ``record`` (an open file) and forwards it."""

    def __init__(self, name, stream, record):
        self._name, self._stream, self._record = name, stream, record

    def write(self, text):
        self._record.write(json.dumps([self._name, text]) + "\n")
        self._record.flush()
        return self._stream.write(text)

    def __getattr__(self, attribute):  # flush, fileno, encoding, isatty, ... of the real stream
        return getattr(self._stream, attribute)


def main() -> int:
    out_dir, script, args = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    record = open(out_dir / f"writes_rank{os.environ.get('RANK', '0')}.jsonl", "w", encoding="utf-8")
    sys.stdout = _RecordingStream("stdout", sys.stdout, record)
    sys.stderr = _RecordingStream("stderr", sys.stderr, record)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` would
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.stdout, sys.stderr = sys.stdout._stream, sys.stderr._stream
        record.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
