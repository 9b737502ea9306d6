"""A TorchDispatchMode that records the name of every aten op run under it (forward and backward)."""
from torch.utils._python_dispatch import TorchDispatchMode


class OpRecorder(TorchDispatchMode):
    """``with OpRecorder() as record: ...``; then ``record.ops`` lists ``str(op)`` in call order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
