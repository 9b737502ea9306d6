"""The base of every checkpoint error (Megatron core_v0.14's name), so callers can tell checkpoint problems from bugs."""


class CheckpointingException(Exception):
    """Base class of every error raised while saving, loading, checking or converting a checkpoint."""
