"""What this rank is doing now (iteration, section, phase): written on the hot path, read by the hang monitor's thread.

The training loop, the schedules and the data iterator write plain attributes of one object,
``PROGRESS`` (a module-global lookup and an attribute store, no lock, no I/O); the hang monitor's daemon
thread (``megatron/core/hang_monitor.py``) reads them when it publishes this rank's heartbeat. A
reader may see a value one write old; the heartbeat is a diagnosis, not a synchronisation.

- ``iteration``: the training iteration in progress (1-based, as the log line counts; 0 before the first);
- ``section``: ``startup``, ``train``, ``evaluation`` or ``checkpoint``;
- ``phase``: inside a step (and inside an evaluation's forward passes): ``data``, ``forward``,
  ``backward``, ``optimizer`` (None outside);
- ``comm``: ``(what, process group)`` while waiting for an asynchronous collective whose wait is not a
  ``torch.distributed`` call on the stack (a ``Work.wait()``: pipeline p2p, overlapped grad reduce and
  param gather), else None. A synchronous collective needs none: the monitor reads it from the stack.
"""

__all__ = ["PROGRESS", "RankProgress", "in_section", "phase_label"]


class RankProgress:
    """The four fields above; one instance per process (``PROGRESS``)."""

    __slots__ = ("iteration", "section", "phase", "comm")

    def __init__(self):
        self.iteration = 0
        self.section = "startup"
        self.phase = None
        self.comm = None


PROGRESS = RankProgress()


class in_section:
    """Context manager: ``PROGRESS.section = name`` (phase cleared) for the block, restored after.
    For cold paths (a checkpoint save, an evaluation); the hot path writes the attributes directly."""

    __slots__ = ("_name", "_saved")

    def __init__(self, name: str):
        self._name = name
        self._saved = None

    def __enter__(self):
        self._saved = (PROGRESS.section, PROGRESS.phase)
        PROGRESS.section, PROGRESS.phase = self._name, None
        return self

    def __exit__(self, exc_type, exc, tb):
        PROGRESS.section, PROGRESS.phase = self._saved
        return False


def phase_label(section, phase) -> str:
    """How the hang report names what a rank was doing: the step phase in training (``backward``),
    the section elsewhere, with the phase in parentheses when there is one (``evaluation (forward)``)."""
    if section == "train":
        return phase or "train (between phases)"
    return f"{section} ({phase})" if phase else str(section)
