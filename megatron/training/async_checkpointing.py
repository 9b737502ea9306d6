"""Old import path of megatron.training.checkpointing.async_save (the ``--async-save`` writer): the same module."""
import sys

from megatron.training.checkpointing import async_save

sys.modules[__name__] = async_save
