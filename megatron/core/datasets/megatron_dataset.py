"""Base class of a split of one data prefix, with the identity (description JSON + md5) that names its cache files."""
from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, Dict, List, Optional

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.utils import Split


def _json_default(obj: Any) -> Any:
    # Tokenizers and nested datasets are described by their identifiers; numpy scalars by value.
    if hasattr(obj, "unique_identifiers"):
        return obj.unique_identifiers
    if isinstance(obj, numpy.generic):
        return obj.item()
    raise TypeError(f"cannot describe {type(obj).__name__} in a dataset cache description")


def describe(identifiers: "OrderedDict[str, Any]") -> str:
    """The cache description: ``identifiers`` as JSON with indent 4 (tokenizers as their ``unique_identifiers``)."""
    return json.dumps(identifiers, indent=4, default=_json_default)


def md5_hex(text: str) -> str:
    """md5 hex digest of ``text`` (UTF-8); names cache files, not a security measure."""
    return hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()


class MegatronDataset(ABC, torch.utils.data.Dataset):
    """One split of one low-level dataset (e.g. an ``IndexedDataset``), sampled by index arrays.

    Args:
        dataset: the low-level dataset (sequences addressable by integer id).
        dataset_path: its path prefix (None for mock data).
        indices: int32 [n] ids of the low-level units that belong to this split.
        num_samples: samples requested (None = one pass over the split).
        index_split: which split this is.
        config: the builder configuration.

    The description (``unique_description``) lists, in order: class, dataset_path, num_samples,
    index_split, then ``_key_config_attributes()``; its md5 (``unique_description_hash``) prefixes
    every cache file, so any change to these rebuilds the indices.
    """

    def __init__(
        self,
        dataset: Any,
        dataset_path: Optional[str],
        indices: numpy.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: BlendedMegatronDatasetConfig,
    ) -> None:
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config

        self.unique_identifiers: "OrderedDict[str, Any]" = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["dataset_path"] = self.dataset_path
        self.unique_identifiers["num_samples"] = self.num_samples
        self.unique_identifiers["index_split"] = self.index_split.name
        for attr in self._key_config_attributes():
            self.unique_identifiers[attr] = getattr(self.config, attr)
        self.unique_identifiers.update(self._extra_identifiers())

        self.unique_description = describe(self.unique_identifiers)
        self.unique_description_hash = md5_hex(self.unique_description)
        self.built_anew_on_cache_miss = False

    @staticmethod
    def _key_config_attributes() -> List[str]:
        """Config fields that shape the indices and therefore belong to the description."""
        return ["random_seed", "sequence_length", "split", "split_matrix", "tokenizer"]

    def _extra_identifiers(self) -> Dict[str, Any]:
        """Further description entries a subclass needs; empty here so the default JSON matches Megatron's."""
        return {}

    @staticmethod
    @abstractmethod
    def numel_low_level_dataset(low_level_dataset: Any) -> int:
        """Number of units (for GPT: sequences) the split fractions are applied to."""

    @staticmethod
    @abstractmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: BlendedMegatronDatasetConfig) -> Any:
        """Open the low-level dataset behind ``dataset_path``."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of samples."""

    @abstractmethod
    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        """Sample ``idx`` as a dict of tensors."""
