"""Megatron core_v0.14's path of ``SAFE_GLOBALS`` (the types a checkpoint may hold) and a scoped context for them.

Both live in :mod:`megatron.core.dist_checkpointing.safe_loading`, with every other rule of reading a
checkpoint without running its code; this module keeps Megatron-LM's import path.
"""
from megatron.core.dist_checkpointing.safe_loading import SAFE_GLOBALS, safe_globals

__all__ = ["SAFE_GLOBALS", "safe_globals"]
