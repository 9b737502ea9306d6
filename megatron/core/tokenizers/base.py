"""The interface every tokenizer offers to datasets, preprocessing and training."""
from __future__ import annotations

import abc
import itertools
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

import numpy


class MegatronTokenizer(abc.ABC):
    """Abstract text tokenizer with Megatron's public surface.

    Subclasses map text to a flat list of integer token ids and back. Special ids that a
    tokenizer does not have are reported as ``None`` (``pad`` as ``-1``, the value Megatron's
    GPTDataset falls back to), so callers can test for them instead of catching errors.

    Args:
        *tokenizer_paths: files the tokenizer was built from (vocab, merges, model).
        **tokenizer_options: options that change the id mapping; recorded in
            ``unique_identifiers`` so dataset caches built with one tokenizer are never
            reused with another.
    """

    def __init__(self, *tokenizer_paths: str, **tokenizer_options) -> None:
        # Same shape as Megatron's (paths as a JSON list), so cache descriptions hash alike.
        self.unique_identifiers: "OrderedDict[str, object]" = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = [str(path) for path in tokenizer_paths]
        for name, value in tokenizer_options.items():
            self.unique_identifiers[name] = str(value)

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of distinct ids the tokenizer can produce (before padding for TP)."""

    @property
    @abc.abstractmethod
    def vocab(self) -> Dict[str, int]:
        """Token string -> id."""

    @property
    @abc.abstractmethod
    def inv_vocab(self) -> Dict[int, str]:
        """Id -> token string."""

    @abc.abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Text -> token ids (no end-of-document id is appended)."""

    @abc.abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Token ids -> text."""

    def tokenize_many(self, texts: Sequence[str]) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """Token ids of many texts at once: ``(ids, counts)``.

        ``ids`` [sum(counts)] int64 holds every text's ids back to back, ``counts`` [len(texts)] int64 how
        many belong to each text; the ids are those of ``tokenize`` on each text. This default calls
        ``tokenize`` per text; a tokenizer with a faster batch path (GPT-2 BPE on tiktoken) overrides it.
        Raises what ``tokenize`` raises.
        """
        per_text = [self.tokenize(text) for text in texts]
        counts = numpy.fromiter(map(len, per_text), dtype=numpy.int64, count=len(per_text))
        ids = numpy.fromiter(itertools.chain.from_iterable(per_text), dtype=numpy.int64, count=int(counts.sum()))
        return ids, counts

    @property
    def eod(self) -> Optional[int]:
        """End-of-document id appended by ``--append-eod``; ``None`` when the tokenizer has none."""
        return None

    @property
    def pad(self) -> int:
        """Padding id; ``-1`` when the tokenizer has none."""
        return -1

    @property
    def bos(self) -> Optional[int]:
        """Beginning-of-sequence id, or ``None``."""
        return None

    @property
    def eos(self) -> Optional[int]:
        """End-of-sequence id, or ``None``."""
        return None

    @property
    def cls(self) -> Optional[int]:
        """Classification id, or ``None``."""
        return None

    @property
    def sep(self) -> Optional[int]:
        """Separator id, or ``None``."""
        return None

    @property
    def mask(self) -> Optional[int]:
        """Mask id, or ``None``."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"
