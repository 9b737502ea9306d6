"""Megatron-LM's ``StrictHandling``: what a torch_dist load does when the requested keys and the checkpoint's differ.

Megatron-LM core_v0.14's names and meanings (``megatron/core/dist_checkpointing/validation.py``): an
*unexpected* key is one this load requests that the checkpoint does not hold; a *missing* key is one the
checkpoint holds that no rank requests. ``serialization.load`` applies the mode.
"""
from enum import Enum
from typing import Union


class StrictHandling(Enum):
    """How a load treats unexpected and missing keys (Megatron-LM's values, the ``--dist-ckpt-strictness`` choices).

    - ``assume_ok_unexpected`` (default): an unexpected key fails the load (the read itself finds it); missing
      keys are not looked for.
    - ``log_unexpected``: unexpected keys are warned about and not read (their tensors keep their values).
    - ``log_all``: as ``log_unexpected``, and missing keys are warned about.
    - ``raise_unexpected``: an unexpected key fails the load, before anything is read.
    - ``raise_all``: an unexpected or a missing key fails the load.
    - ``return_unexpected`` / ``return_all``: the mismatches are returned to the caller (Megatron's API); the
      training loop has no use for them, so its configuration refuses these two.
    - ``ignore_all``: unexpected keys are not read, nothing is said.
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_global_app_metadata(val: "StrictHandling") -> bool:
        """Whether the mode looks for missing keys (which needs every rank's requested keys)."""
        return val in (StrictHandling.IGNORE_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL,
                       StrictHandling.LOG_ALL)

    @staticmethod
    def requires_returning_mismatch_keys(val: "StrictHandling") -> bool:
        """Whether the mode hands the mismatched keys back to the caller."""
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)

    @staticmethod
    def skips_unexpected(val: "StrictHandling") -> bool:
        """Whether unexpected keys are left out of the read instead of failing it."""
        return val in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL, StrictHandling.IGNORE_ALL,
                       StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: Union[str, StrictHandling]) -> StrictHandling:
    """``strict`` as a StrictHandling (a value string or the enum itself); ValueError naming the valid values."""
    if isinstance(strict, StrictHandling):
        return strict
    try:
        return StrictHandling(strict)
    except (ValueError, TypeError):
        raise ValueError(f"invalid strict flag {strict!r}: choose one of "
                         f"{', '.join(mode.value for mode in StrictHandling)}") from None
