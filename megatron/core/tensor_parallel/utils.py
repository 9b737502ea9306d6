"""Small helpers for tensor-parallel code: exact division, tensor splitting and vocab ranges."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Raise ValueError unless ``numerator`` is divisible by ``denominator``."""
    if denominator == 0 or numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int) -> int:
    """Exact integer division; raises ValueError if ``numerator % denominator != 0``."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> Sequence[torch.Tensor]:
    """Split ``tensor`` [..., n] into ``num_partitions`` views [..., n/num_partitions].

    Raises ValueError if the last dimension is not divisible by ``num_partitions``.
    """
    last_dim_size = divide(tensor.size(-1), num_partitions)
    chunks = torch.split(tensor, last_dim_size, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


class VocabUtility:
    """Vocabulary range ``[first, last)`` owned by a tensor-parallel rank (contiguous equal blocks)."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                                  world_size: int) -> Tuple[int, int]:
        """Range of ids held by ``rank`` when each rank holds ``per_partition_vocab_size`` ids."""
        index_f = rank * per_partition_vocab_size
        return index_f, index_f + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> Tuple[int, int]:
        """Range of ids held by ``rank``; raises ValueError if the vocab does not split evenly."""
        per_partition_vocab_size = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition_vocab_size, rank, world_size)


def split_first_dim_chunks(tensor: torch.Tensor, num_partitions: int) -> List[torch.Tensor]:
    """Split ``tensor`` [n, ...] into ``num_partitions`` views [n/num_partitions, ...]."""
    return list(torch.split(tensor, divide(tensor.size(0), num_partitions), dim=0))
