"""Mix several datasets of one split by weight, with a greedy blending index that may be cached."""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.megatron_dataset import MegatronDataset, describe, md5_hex
from megatron.core.datasets.utils import is_cache_builder, log_single_rank, normalize, save_atomically

logger = logging.getLogger(__name__)

_MAX_DATASETS = 32767  # dataset ids are stored as int16


def _greedy_blend(weights: Sequence[float], size: int,
                  capacities: Sequence[int] = None) -> Tuple[numpy.ndarray, numpy.ndarray]:
    """Sample k goes to the dataset i with the largest ``weights[i] * max(k, 1) - count[i]`` (ties: lowest i).

    With ``capacities``, a dataset that has given ``capacities[i]`` samples drops out of the choice.
    """
    counts = [0] * len(weights)
    candidates = [i for i in range(len(weights)) if capacities is None or capacities[i] > 0]
    chosen = [0] * size
    within = [0] * size
    for k in range(size):
        kk = float(max(k, 1))
        best, best_error = -1, -float("inf")
        for i in candidates:
            error = weights[i] * kk - counts[i]
            if error > best_error:
                best, best_error = i, error
        chosen[k] = best
        within[k] = counts[best]
        counts[best] += 1
        if capacities is not None and counts[best] == capacities[best]:
            candidates.remove(best)
    return numpy.array(chosen, dtype=numpy.int16), numpy.array(within, dtype=numpy.int64)


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[numpy.ndarray, numpy.ndarray]:
    """Greedy weighted interleaving (Megatron's ``helpers.build_blending_indices``).

    Sample k goes to the dataset i with the largest error ``weights[i] * max(k, 1) - count[i]``
    (float64; ties go to the lowest i); ``count[i]`` is how many samples dataset i has given so far.

    Args:
        weights: normalised weights, one per dataset.
        size: number of samples to produce.

    Returns:
        dataset_index int16 [size], dataset_sample_index int64 [size] (the sample's index in its dataset).
    """
    return _greedy_blend([float(x) for x in weights], size)


def build_exhaustive_blending_indices(sizes: Sequence[int]) -> Tuple[numpy.ndarray, numpy.ndarray]:
    """Interleave every sample of every dataset exactly once, in proportion to ``sizes``.

    Same greedy rule as ``build_blending_indices`` with weights ``sizes / sum(sizes)``, restricted to the
    datasets that still have samples left (Megatron's ``helpers.build_exhaustive_blending_indices``).

    Returns:
        dataset_index int16 [sum(sizes)], dataset_sample_index int64 [sum(sizes)].
    """
    sizes = [int(s) for s in sizes]
    total = sum(sizes)
    weights = [s / float(total) for s in sizes] if total else [0.0] * len(sizes)
    return _greedy_blend(weights, total, capacities=sizes)


class BlendedDataset(torch.utils.data.Dataset):
    """A weighted mixture of datasets of the same class and split.

    Args:
        datasets: the component datasets (``MegatronDataset`` of one class and one split).
        weights: per-dataset weights (normalised here when ``size`` is given), or with ``size=None``
            integer sample counts to take exhaustively (usually the datasets' lengths).
        size: number of samples, or None for ``sum(weights)``.
        config: the builder configuration (``path_to_cache`` enables caching).

    ``dataset[i]`` is the component sample plus ``"dataset_id"`` (int). Indices are cached under
    ``path_to_cache`` only, as ``{md5}-BlendedDataset-{split}-{dataset_index,dataset_sample_index}.npy``.

    Raises:
        ValueError: mismatched or invalid datasets/weights.
        IndexError: the blend asks a component for more samples than it holds.
        RuntimeError: a rank other than 0 finds no cache.
    """

    def __init__(
        self,
        datasets: List[MegatronDataset],
        weights: List[Union[int, float]],
        size: Optional[int],
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"BlendedDataset: {len(datasets)} datasets but {len(weights)} weights")
        if not datasets or len(datasets) >= _MAX_DATASETS:
            raise ValueError(f"BlendedDataset needs 1 to {_MAX_DATASETS - 1} datasets, got {len(datasets)}")
        if any(type(d) is not type(datasets[0]) for d in datasets):
            raise ValueError("BlendedDataset components must all be of the same class")
        if any(d.index_split != datasets[0].index_split for d in datasets):
            raise ValueError("BlendedDataset components must all belong to the same split")
        if any(w <= 0 for w in weights):
            raise ValueError(f"BlendedDataset weights must be positive, got {list(weights)}")
        if size is None and any(float(w) != int(w) for w in weights):
            raise ValueError("BlendedDataset with size=None takes integer sample counts as weights")
        if size is not None and size < 0:
            raise ValueError(f"BlendedDataset size must be >= 0 or None, got {size}")
        if len(datasets) == 1:
            log_single_rank(logger, logging.WARNING, "Building a BlendedDataset for a single MegatronDataset")

        if size is not None:
            weights = normalize(weights)
        self.datasets = datasets
        self.split = datasets[0].index_split
        self.weights = list(weights)
        self.size = size
        self.config = config

        identifiers: "OrderedDict[str, Any]" = OrderedDict()
        identifiers["class"] = type(self).__name__
        identifiers["datasets"] = [d.unique_identifiers for d in self.datasets]
        identifiers["split"] = self.split.name
        identifiers["weights"] = self.weights
        identifiers["size"] = self.size
        self.unique_identifiers = identifiers
        self.unique_description = describe(identifiers)
        self.unique_description_hash = md5_hex(self.unique_description)
        self.built_anew_on_cache_miss = False

        self.dataset_index, self.dataset_sample_index = self._build_indices()
        self._check_no_oversampling()

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, idx: int) -> Dict[str, Any]:
        dataset_id = int(self.dataset_index[idx])
        sample = self.datasets[dataset_id][int(self.dataset_sample_index[idx])]
        return {"dataset_id": dataset_id, **sample}

    def _check_no_oversampling(self) -> None:
        counts = numpy.bincount(numpy.asarray(self.dataset_index, dtype=numpy.int64), minlength=len(self.datasets))
        for i, (count, dataset) in enumerate(zip(counts, self.datasets)):
            if count > len(dataset):
                raise IndexError(
                    f"The {self.split.name} blend oversamples the contributing datasets and, for example, "
                    f"requests {int(count)} samples from {type(dataset).__name__} {i} "
                    f"({getattr(dataset, 'dataset_path', None)}) with size {len(dataset)}; "
                    "build the components with at least as many samples (see --mid-level-dataset-surplus)"
                )

    def _build_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray]:
        path_to_cache = self.config.path_to_cache
        paths = None
        if path_to_cache:
            base = f"{self.unique_description_hash}-{type(self).__name__}-{self.split.name}"
            paths = {
                name: os.path.join(path_to_cache, f"{base}-{name}")
                for name in ("description.txt", "dataset_index.npy", "dataset_sample_index.npy")
            }
        cache_hit = paths is not None and all(os.path.isfile(p) for p in paths.values())

        if cache_hit:
            log_single_rank(logger, logging.INFO, f"Load the {type(self).__name__} {self.split.name} indices")
            return (
                numpy.load(paths["dataset_index.npy"], allow_pickle=False, mmap_mode="r"),
                numpy.load(paths["dataset_sample_index.npy"], allow_pickle=False, mmap_mode="r"),
            )
        if paths is not None and not is_cache_builder():
            raise RuntimeError(
                f"rank {torch.distributed.get_rank()}: no cached {type(self).__name__} {self.split.name} indices in "
                f"{path_to_cache}; rank 0 builds them first (use BlendedMegatronDatasetBuilder)"
            )

        log_single_rank(logger, logging.INFO, f"Build and save the {type(self).__name__} {self.split.name} indices")
        self.built_anew_on_cache_miss = True
        t_beg = time.time()
        if self.size is not None:
            dataset_index, dataset_sample_index = build_blending_indices(self.weights, self.size)
        else:
            dataset_index, dataset_sample_index = build_exhaustive_blending_indices(self.weights)
        if paths is not None:
            os.makedirs(path_to_cache, exist_ok=True)
            save_atomically(paths["dataset_index.npy"], dataset_index)
            save_atomically(paths["dataset_sample_index.npy"], dataset_sample_index)
            save_atomically(paths["description.txt"], self.unique_description)
        log_single_rank(logger, logging.DEBUG, f"\tbuilt the blending indices in {time.time() - t_beg:.4f} s")
        return dataset_index, dataset_sample_index
