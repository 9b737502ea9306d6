"""Run ``python ARGS...`` and write its exit status to ``DIR/exit_rank$RANK`` (a test launcher wrapper).

torchrun stops reporting its workers once it has been signalled itself, so a test that signals
torchrun cannot read the ranks' exit statuses from it; this wrapper sits between torchrun and the
rank. It outlives the signal (a no-op handler; handlers, unlike ignored signals, are not inherited
across exec, so the rank still sees the signal's default disposition) and records the status:
``N`` for exit code N, ``-S`` for death by signal S.
"""
import os
import signal
import subprocess
import sys
from pathlib import Path


def main() -> int:
    out_dir, argv = Path(sys.argv[1]), sys.argv[2:]
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    status = subprocess.run([sys.executable, *argv]).returncode
    (out_dir / f"exit_rank{os.environ['RANK']}").write_text(str(status))
    return 0 if status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
