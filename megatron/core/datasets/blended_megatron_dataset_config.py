"""Configuration shared by every dataset the BlendedMegatronDatasetBuilder builds: blend, split, seed, cache."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from megatron.core.datasets.utils import (
    Split,
    convert_split_vector_to_split_matrix,
    log_single_rank,
    parse_and_normalize_split,
)

logger = logging.getLogger(__name__)

Blend = Tuple[List[str], Optional[List[float]]]


def _check_blend(blend: Any, name: str) -> None:
    if not (isinstance(blend, (tuple, list)) and len(blend) == 2):
        raise ValueError(f"{name} must be a (prefixes, weights) pair as returned by get_blend_from_list, got {blend!r}")
    prefixes, weights = blend
    if not prefixes:
        raise ValueError(f"{name}: no data prefixes given")
    if weights is not None:
        if len(weights) != len(prefixes):
            raise ValueError(
                f"{name}: {len(prefixes)} prefixes but {len(weights)} weights; prefixes and weights must be equal in number"
            )
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"{name}: weights must be non-negative and not all zero, got {list(weights)}")


@dataclass
class BlendedMegatronDatasetConfig:
    """Everything that decides which samples a Megatron dataset holds.

    Attributes:
        random_seed: seed of the ``numpy.random.RandomState`` that shuffles the indices (``--seed``).
        sequence_length: tokens per sample S (``--seq-length``).
        blend: ``(prefixes, weights or None)`` from ``--data-path`` (see ``get_blend_from_list``).
        blend_per_split: ``[train, valid, test]`` blends from ``--train/valid/test-data-path``
            (entries may be None); exclusive with ``blend`` and ``split``.
        split: ``--split`` string, e.g. ``"969, 30, 1"``; required with ``blend``; forced to
            ``"1,1,1"`` in mock mode.
        split_matrix: derived per-split ``(begin, end)`` fractions (``None`` = split not built).
        num_dataset_builder_threads: threads building the per-prefix datasets of a blend.
        path_to_cache: ``--data-cache-path``; None means next to each data prefix (none for mock).
        mmap_bin_files: memory-map the ``.bin`` files (``--no-mmap-bin-files`` turns it off).
        mock: no real data; set automatically when neither ``blend`` nor ``blend_per_split`` is given.
        tokenizer: object with ``eod``, ``pad``, ``vocab_size`` and ``unique_identifiers``.
        mid_level_dataset_surplus: extra fraction of samples built per blended component (0.005).

    Raises:
        ValueError: conflicting or malformed options; the message names the flag.
    """

    random_seed: int
    sequence_length: int
    blend: Optional[Blend] = None
    blend_per_split: Optional[List[Optional[Blend]]] = None
    split: Optional[str] = None
    split_matrix: Optional[List[Optional[Tuple[float, float]]]] = field(init=False, default=None)
    num_dataset_builder_threads: int = 1
    path_to_cache: Optional[str] = None
    mmap_bin_files: bool = True
    mock: bool = False
    tokenizer: Optional[Any] = None
    mid_level_dataset_surplus: float = 0.005

    def __post_init__(self) -> None:
        if not isinstance(self.sequence_length, int) or self.sequence_length < 1:
            raise ValueError(f"--seq-length must be a positive integer, got {self.sequence_length!r}")
        if not isinstance(self.random_seed, int):
            raise ValueError(f"--seed must be an integer, got {self.random_seed!r}")
        if not isinstance(self.num_dataset_builder_threads, int) or self.num_dataset_builder_threads < 1:
            raise ValueError(
                f"--num-dataset-builder-threads must be a positive integer, got {self.num_dataset_builder_threads!r}"
            )
        if self.mid_level_dataset_surplus < 0:
            raise ValueError(f"--mid-level-dataset-surplus must be >= 0, got {self.mid_level_dataset_surplus}")

        has_per_split = self.blend_per_split is not None and any(b is not None for b in self.blend_per_split)
        if self.mock and (self.blend is not None or has_per_split):
            raise ValueError("--mock-data cannot be combined with --data-path or --train/valid/test-data-path")

        if has_per_split:
            if self.blend is not None:
                raise ValueError("--data-path and --train/valid/test-data-path are incompatible; give one or the other")
            if self.split is not None:
                raise ValueError("--split cannot be used with --train/valid/test-data-path (each split has its own data)")
            if len(self.blend_per_split) != len(Split):
                raise ValueError(
                    f"blend_per_split must hold {len(Split)} blends ({[s.name for s in Split]}), "
                    f"got {len(self.blend_per_split)}"
                )
            for split in Split:
                blend = self.blend_per_split[split.value]
                if blend is None:
                    log_single_rank(logger, logging.INFO, f"blend not provided for {split.name} split")
                else:
                    _check_blend(blend, f"--{split.name}-data-path")
            return

        self.blend_per_split = None
        if self.blend is not None:
            _check_blend(self.blend, "--data-path")
            if self.split is None:
                raise ValueError("--split must be provided with --data-path")
        else:
            self.mock = True
            log_single_rank(logger, logging.INFO, "Let mock = True, as both blend and blend_per_split are None")
            self.split = "1,1,1"
            log_single_rank(logger, logging.INFO, f"Let split = {self.split}, an arbitrarily even split, as mock is True")
        self.split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(self.split))
        log_single_rank(logger, logging.INFO, f"Let split_matrix = {self.split_matrix}")
