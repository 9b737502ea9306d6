"""Megatron's ``get_batch_on_this_cp_rank``: keep this context-parallel rank's two chunks of every batch tensor."""
from typing import Dict, Optional

import torch

from megatron.core import parallel_state
from megatron.core.transformer.context_parallel import local_positions


def get_batch_on_this_cp_rank(batch: Dict[str, Optional[torch.Tensor]], cp_size: Optional[int] = None,
                              cp_rank: Optional[int] = None) -> Dict[str, Optional[torch.Tensor]]:
    """``batch`` with each tensor cut to the tokens this CP rank holds (chunks ``r`` and ``2 cp - 1 - r``).

    ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` ``[b, s]`` are split along dim 1;
    ``attention_mask`` ``[b, 1, s, s]`` keeps its query rows (dim 2) only, the key dim stays whole (as
    Megatron-LM). None entries stay None. ``cp_size``/``cp_rank`` default to parallel_state's; at one
    rank the batch is returned unchanged. Raises ValueError when ``s`` is not divisible by ``2 cp``.
    """
    if cp_size is None:
        cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size == 1:
        return batch
    if cp_rank is None:
        cp_rank = parallel_state.get_context_parallel_rank()
    out = {}
    index = None
    for key, value in batch.items():
        if value is None:
            out[key] = None
            continue
        seq_dim = 2 if key == "attention_mask" else 1
        if index is None or index.device != value.device:
            index = local_positions(value.size(seq_dim), cp_size, cp_rank, device=value.device)
        out[key] = value.index_select(seq_dim, index)
    return out
