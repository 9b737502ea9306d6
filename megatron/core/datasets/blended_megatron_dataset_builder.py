"""Build the train/valid/test datasets of a config: split each prefix, size it, blend the prefixes, sync ranks."""
from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Optional, Sequence, Type

import numpy
import torch

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split, log_single_rank, normalize

logger = logging.getLogger(__name__)

SplitMatrix = List[Optional[tuple]]


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _get_size_per_split_per_dataset(
    normalized_weights: Sequence[float], target_size_per_split: Sequence[Optional[int]], surplus: float = 0.0
) -> List[List[Optional[int]]]:
    """Samples to take (surplus 0) or build (surplus > 0) from each prefix for each split.

    ``ceil(ceil(size * w) * (1 + surplus))``; a split of size None stays None.

    Returns:
        [num_prefixes][num_splits] sample counts.
    """
    return [
        [
            None if size is None else int(math.ceil(math.ceil(size * weight) * (1 + surplus)))
            for size in target_size_per_split
        ]
        for weight in normalized_weights
    ]


class BlendedMegatronDatasetBuilder:
    """Builds ``[train, valid, test]`` datasets of class ``cls`` as Megatron-LM does.

    Args:
        cls: a ``MegatronDataset`` subclass (e.g. ``GPTDataset`` or ``MockGPTDataset``).
        sizes: samples wanted per split; None = one pass over the split (only without weights);
            0 = do not build the split.
        is_built_on_rank: returns True on the ranks that hold data (others get None); must be True on rank 0.
        config: the dataset configuration.

    With several ranks, rank 0 builds (and caches) every index first, then a barrier lets the other
    ranks load the caches; the number of barriers is the same on every rank.

    Raises:
        ValueError: a split with a weighted blend has size None, or ``sizes`` is not 3 long.
        RuntimeError: ``is_built_on_rank()`` is False on global rank 0.
    """

    def __init__(
        self,
        cls: Type[MegatronDataset],
        sizes: Sequence[Optional[int]],
        is_built_on_rank: Callable[[], bool],
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        if len(sizes) != len(Split):
            raise ValueError(f"sizes must give one entry per split {[s.name for s in Split]}, got {list(sizes)}")
        if any(s is not None and s < 0 for s in sizes):
            raise ValueError(f"split sizes must be >= 0 or None, got {list(sizes)}")
        self.cls = cls
        self.sizes = list(sizes)
        self.is_built_on_rank = is_built_on_rank
        self.config = config

        log_single_rank(
            logger, logging.INFO,
            f"Building {cls.__name__} splits with sizes={tuple(self.sizes)} and config={self.config}",
        )
        if not config.mock:
            for split in Split:
                if self.sizes[split.value] is not None:
                    continue
                if config.blend_per_split is None:
                    weights = config.blend[1]
                else:
                    blend = config.blend_per_split[split.value]
                    if blend is None:
                        continue
                    weights = blend[1]
                if weights is not None:
                    raise ValueError(
                        f"the {split.name} split has no requested size (e.g. --full-validation), "
                        "which a weighted blend cannot honour; give a size or drop the weights"
                    )
        if _distributed() and torch.distributed.get_rank() == 0 and not self.is_built_on_rank():
            raise RuntimeError("is_built_on_rank must return True when global rank = 0")

    def build(self) -> List[Optional[Any]]:
        """Build the datasets.

        Returns:
            ``[train, valid, test]``; an entry is None when that split is zero-width, has size 0,
            has no blend, or this rank does not hold data.

        Raises:
            FileNotFoundError: a data prefix's ``.bin``/``.idx`` is missing (names the prefix).
            ValueError: samples requested from a split that holds no tokens.
            IndexError: a blend oversamples a component.
        """
        return self._build_blended_dataset_splits()

    def _effective_split(self, split: SplitMatrix, sizes: Sequence[Optional[int]]) -> SplitMatrix:
        # A split asked for zero samples is not built at all.
        return [None if s is None or size == 0 else s for s, size in zip(split, sizes)]

    def _build_blended_dataset_splits(self) -> List[Optional[Any]]:
        if self.config.mock:
            split = self._effective_split(self.config.split_matrix, self.sizes)
            return self._build_megatron_dataset_splits(None, split, self.sizes)

        if self.config.blend:
            prefixes, weights = self.config.blend
            split = self._effective_split(self.config.split_matrix, self.sizes)
            return self._build_blend(prefixes, weights, split, self.sizes)

        datasets: List[Optional[Any]] = [None] * len(Split)
        for i in range(len(Split)):
            blend = self.config.blend_per_split[i]
            if blend is None or self.sizes[i] == 0:
                continue
            split_spoof: SplitMatrix = [None] * len(Split)
            split_spoof[i] = (0.0, 1.0)
            sizes_spoof: List[Optional[int]] = [0] * len(Split)
            sizes_spoof[i] = self.sizes[i]
            datasets[i] = self._build_blend(blend[0], blend[1], split_spoof, sizes_spoof)[i]
        return datasets

    def _build_blend(
        self, prefixes: List[str], weights: Optional[List[float]], split: SplitMatrix, sizes: Sequence[Optional[int]]
    ) -> List[Optional[Any]]:
        """Datasets of every split for one blend (a plain dataset when it is a single unweighted prefix)."""
        if weights is not None:
            weights = normalize(weights)
        if len(prefixes) == 1 and weights is None:
            return self._build_megatron_dataset_splits(prefixes[0], split, sizes)

        if weights is None:
            sizes_per_dataset_target = None
            sizes_per_dataset_buffer = [[None] * len(Split) for _ in prefixes]
        else:
            sizes_per_dataset_target = _get_size_per_split_per_dataset(weights, sizes)
            sizes_per_dataset_buffer = _get_size_per_split_per_dataset(
                weights, sizes, surplus=self.config.mid_level_dataset_surplus
            )
        megatron_datasets = self._build_megatron_datasets_parallel(prefixes, split, sizes_per_dataset_buffer)

        blended: List[Optional[Any]] = [None] * len(Split)
        for i in range(len(Split)):
            if split[i] is None:
                continue
            if weights is not None:
                weights_i = weights
                size_i = sum(row[i] for row in sizes_per_dataset_target)
            else:
                # Without weights each prefix counts by its length (one pass over every component).
                if any(d is None for d in megatron_datasets[i]):
                    weights_i = [0 for _ in prefixes]
                else:
                    weights_i = [len(d) for d in megatron_datasets[i]]
                size_i = None if sizes[i] is None else min(sizes[i], sum(weights_i))
            blended[i] = self._build_generic_dataset(
                BlendedDataset, True, megatron_datasets[i], weights_i, size_i, self.config
            )
        return blended

    def _build_megatron_datasets_parallel(
        self, prefixes: List[str], split: SplitMatrix, sizes_per_dataset: List[List[Optional[int]]]
    ) -> List[List[Optional[MegatronDataset]]]:
        """Per-split lists of per-prefix datasets, built by ``num_dataset_builder_threads`` threads.

        Rank 0 builds first; after one barrier the other ranks build (cache hits).
        """
        def build_all(num_workers: int) -> List[List[Optional[MegatronDataset]]]:
            out: List[List[Optional[MegatronDataset]]] = [[] for _ in Split]
            with ThreadPoolExecutor(max_workers=num_workers) as executor:
                futures = [
                    executor.submit(self._build_megatron_dataset_splits, prefix, split, sizes, False)
                    for prefix, sizes in zip(prefixes, sizes_per_dataset)
                ]
                for future in futures:
                    for j, dataset in enumerate(future.result()):
                        out[j].append(dataset)
            return out

        threads = self.config.num_dataset_builder_threads
        if not _distributed():
            return build_all(threads)
        rank = torch.distributed.get_rank()
        result = None
        if rank == 0:
            # Only rank 0 works before the barrier, so it may use more threads; stay modest on a miss.
            workers = threads * min(2, max(1, torch.cuda.device_count())) if threads > 1 else 1
            result = build_all(workers)
        torch.distributed.barrier()
        if rank != 0:
            result = build_all(threads)
        return result

    def _build_megatron_dataset_splits(
        self, dataset_path: Optional[str], split: SplitMatrix, sizes: Sequence[Optional[int]], synchronize_ranks: bool = True
    ) -> List[Optional[MegatronDataset]]:
        """The split datasets of one prefix (or of the mock data when ``dataset_path`` is None)."""
        if _distributed() and not self.is_built_on_rank():
            # Match the barriers the data-holding ranks perform below.
            for i in range(len(Split)):
                if split[i] is not None and synchronize_ranks:
                    torch.distributed.barrier()
            return [None] * len(Split)

        low_level_dataset = self.cls.build_low_level_dataset(dataset_path, self.config)
        num_elements = self.cls.numel_low_level_dataset(low_level_dataset)
        datasets: List[Optional[MegatronDataset]] = []
        for i, _split in enumerate(Split):
            if split[i] is None:
                datasets.append(None)
                continue
            begin = int(round(split[i][0] * float(num_elements)))
            end = int(round(split[i][1] * float(num_elements)))
            indices = numpy.arange(begin, end, dtype=numpy.int32)
            if indices.size == 0 and sizes[i]:
                raise ValueError(
                    f"the {_split.name} split of {dataset_path or 'the mock dataset'} is empty "
                    f"({num_elements} sequences, split {self.config.split!r} gives [{begin}, {end})) "
                    f"but {sizes[i]} samples were requested; change --split or use more data"
                )
            datasets.append(
                self._build_generic_dataset(
                    self.cls, synchronize_ranks, low_level_dataset, dataset_path, indices, sizes[i], _split, self.config
                )
            )
        return datasets

    def _build_generic_dataset(self, cls: Type, synchronize_ranks: bool, *args: Any) -> Optional[Any]:
        """``cls(*args)`` on rank 0 first, then (after a barrier) on the other data-holding ranks."""
        if not _distributed():
            return cls(*args)
        rank = torch.distributed.get_rank()
        dataset = None
        if rank == 0 and self.is_built_on_rank():
            dataset = cls(*args)
        if synchronize_ranks:
            torch.distributed.barrier()
        if rank != 0 and self.is_built_on_rank():
            dataset = cls(*args)
        return dataset
