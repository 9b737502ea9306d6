"""Megatron-LM's entry point for finishing ``--async-save`` checkpoints (``megatron/training/async_utils.py``).

The work is done by ``checkpointing.finalize_async_save``; the training loop calls it itself (every
iteration while a save is pending, before the next save, before exit). Scripts that drive
``save_checkpoint`` on their own call this function as they would in Megatron-LM.
"""
from megatron.training.checkpointing import finalize_async_save


def maybe_finalize_async_save(blocking: bool = False, terminate: bool = False) -> bool:
    """Publish the pending ``--async-save`` checkpoint once every rank has written it; all ranks call it.

    ``blocking`` (or ``terminate``, Megatron's flag for stopping its persistent worker, of which this
    version has none) waits for the background writes; otherwise only an already finished save is
    published. Returns True when no save is pending any more. Raises like ``save_checkpoint`` when a
    background write failed on any rank.
    """
    return finalize_async_save(blocking=blocking or terminate)
