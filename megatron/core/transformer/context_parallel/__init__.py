"""Context parallelism's attention: each rank holds two load-balanced chunks of every sequence (Megatron-LM).

The global sequence of ``s`` tokens is cut into ``2 * cp`` chunks of ``s / (2 * cp)`` tokens; CP rank ``r``
holds chunks ``r`` and ``2 * cp - 1 - r`` (in that order), so under a causal mask every rank does the same
attention work (Megatron-LM's ``get_batch_on_this_cp_rank``). The three ways of attending across the
chunks, chosen by ``--cp-comm-type``, each live in their own module with an ``attention`` function of the
same signature (see :func:`context_parallel_attention`):

- ``p2p`` (``ring_attention.py``): K/V blocks passed around the ring, combined with the online-softmax
  log-sum-exp rule (Liu et al. 2023, "Ring Attention with Blockwise Transformers", section 3);
- ``all_gather`` (``all_gather_attention.py``): K/V all-gathered, dK/dV reduce-scattered;
- ``a2a`` (``all_to_all_attention.py``): all-to-all between heads and sequence (Jacobs et al. 2023,
  "DeepSpeed Ulysses", section 3).
"""
import importlib
from typing import List

import torch

CP_COMM_TYPES = ("p2p", "all_gather", "a2a")
_MODULES = {"p2p": "ring_attention", "all_gather": "all_gather_attention", "a2a": "all_to_all_attention"}


def chunk_ids(cp_size: int, cp_rank: int) -> List[int]:
    """The two chunks (of ``2 * cp_size``) that CP rank ``cp_rank`` holds, in the order it holds them."""
    return [cp_rank, 2 * cp_size - 1 - cp_rank]


def local_positions(seq_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global token positions ``[seq_length / cp_size]`` (int64) of the tokens this CP rank holds.

    Raises ValueError when ``seq_length`` is not divisible by ``2 * cp_size``.
    """
    if seq_length % (2 * cp_size) != 0:
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 x context_parallel_size ({cp_size})")
    chunk = seq_length // (2 * cp_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunk_ids(cp_size, cp_rank)])


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, cp_group,
                               comm_type: str, softmax_scale: float) -> torch.Tensor:
    """Causal attention over the whole sequence when each CP rank holds two load-balanced chunks of it.

    Args:
        query: ``[b, np, s_local, hn]`` this rank's queries (``s_local = s / cp``, chunks per :func:`chunk_ids`).
        key, value: ``[b, ng, s_local, hn]`` this rank's keys/values; ``np`` is a multiple of ``ng`` (GQA).
        cp_group: the context-parallel process group (``parallel_state.get_context_parallel_group()``).
        comm_type: one of :data:`CP_COMM_TYPES`.
        softmax_scale: the scale of ``q kᵀ`` (``1 / sqrt(hn)`` unless configured).

    Returns ``[b, np, s_local, hn]``, equal (to rounding) to the rows of full causal attention over the
    gathered sequence that this rank holds. No dropout. Backward is written per comm type (no ``[s, s]``
    score matrix is kept for it). Raises ValueError for an unknown ``comm_type``.
    """
    if comm_type not in _MODULES:
        raise ValueError(f"--cp-comm-type {comm_type!r}: choose one of {', '.join(CP_COMM_TYPES)}")
    module = importlib.import_module(f"{__name__}.{_MODULES[comm_type]}")
    return module.attention(query, key, value, cp_group=cp_group, softmax_scale=softmax_scale)
