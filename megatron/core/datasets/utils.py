"""Small dataset helpers shared by the builders: the Split enum, blend and split-string parsing, rank-0 logging."""
from __future__ import annotations

import logging
import os
import re
import threading
from enum import Enum
from typing import Any, List, Optional, Sequence, Tuple

import numpy
import torch


class Split(Enum):
    """The three dataset splits, in Megatron's order (the value indexes per-split lists)."""

    train = 0
    valid = 1
    test = 2


def log_single_rank(logger: logging.Logger, *args: Any, rank: int = 0, **kwargs: Any) -> None:
    """``logger.log(*args, **kwargs)`` on global rank ``rank`` only (every process when not distributed)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_rank() != rank:
            return
    logger.log(*args, **kwargs)


def is_cache_builder() -> bool:
    """True on the process that builds and saves index caches: global rank 0, or any process when not distributed."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) or torch.distributed.get_rank() == 0


def save_atomically(path: str, payload: Any) -> None:
    """Write ``payload`` (a numpy array as ``.npy``, or a str as UTF-8 text) to ``path`` atomically.

    The data goes to a temporary file in the same directory, which is then renamed over ``path``, so a
    reader never sees a partial file.

    Raises:
        OSError: the directory is not writable.
    """
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    try:
        if isinstance(payload, str):
            with open(tmp, "wt", encoding="utf-8") as stream:
                stream.write(payload)
        else:
            with open(tmp, "wb") as stream:
                numpy.save(stream, payload, allow_pickle=False)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def normalize(weights: Sequence[float]) -> List[float]:
    """Scale non-negative ``weights`` to sum to 1 (float64 division, as Megatron does).

    Raises:
        ValueError: a weight is negative, or all weights are zero.
    """
    array = numpy.asarray(weights, dtype=numpy.float64)
    if array.size == 0 or (array < 0).any() or array.sum() <= 0:
        raise ValueError(f"blend weights must be non-negative and not all zero, got {list(weights)}")
    return (array / numpy.sum(array)).tolist()


def get_blend_from_list(blend: Optional[Sequence[str]]) -> Optional[Tuple[List[str], Optional[List[float]]]]:
    """Parse the words of ``--data-path`` (or ``--train/valid/test-data-path``) into ``(prefixes, weights)``.

    Accepted forms: ``prefix``; ``w1 p1 w2 p2 ...`` (an even count whose every even-position word is a
    number); or ``p1 p2 ...`` (an odd count, or no word at a weight position is a number), which gives
    ``weights = None`` (the builder then weights each prefix by its dataset length).
    Weights are returned as given (not normalised).

    Returns:
        None for None, else (list of prefixes, list of float weights or None).

    Raises:
        ValueError: the list is empty, or some weight positions hold numbers and others do not
            (e.g. ``0.3 a b c``).
    """
    if blend is None:
        return None
    words = [str(word) for word in blend]
    if not words:
        raise ValueError("--data-path: an empty list of data prefixes was given")
    if len(words) % 2 == 1:
        return [word.strip() for word in words], None

    raw_weights, raw_prefixes = words[0::2], words[1::2]
    weights: List[Optional[float]] = []
    for raw in raw_weights:
        try:
            weights.append(float(raw))
        except ValueError:
            weights.append(None)
    missing = [w is None for w in weights]
    if all(missing):
        return [word.strip() for word in words], None
    if any(missing):
        bad = raw_weights[missing.index(True)]
        raise ValueError(
            f"--data-path {' '.join(words)}: expected 'weight prefix' pairs but {bad!r} is not a number; "
            "give either only prefixes or a weight before every prefix"
        )
    return [prefix.strip() for prefix in raw_prefixes], weights


# One weight of --split: digits with an optional fraction ("969", "0.5", ".5"); no sign, no exponent.
_SPLIT_NUMBER = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
# The whole --split: up to three weights separated by ',' or '/' (Megatron-LM's forms), '-' or blanks
# (which Megatron-LM's number search also reads as separators: "98-2", "98 2").
_SPLIT_FORM = re.compile(rf"\s*{_SPLIT_NUMBER}(?:(?:\s*[,/-]\s*|\s+){_SPLIT_NUMBER})*\s*")


def parse_and_normalize_split(split: str) -> List[float]:
    """Parse a ``--split`` string such as ``"969, 30, 1"`` into three fractions summing to 1.

    Accepts one to three non-negative numbers (``"969,30,1"``, ``"98,2"``, ``"1"``) separated by ``,``
    or ``/`` as Megatron-LM documents them, or by ``-`` or blanks, which Megatron-LM's number search
    reads as separators too; fewer than three numbers are padded with 0.0. Anything else (a word, a
    stray character such as the ``x`` of ``"98,2,x"``) is refused rather than skipped. A ``-``
    directly before a number that does not follow a digit is a minus sign: such a weight is refused
    rather than read as positive.

    Raises:
        ValueError: naming ``--split`` and the value: a negative weight, anything but numbers and
            separators, more than three numbers, or all numbers zero.
    """
    for minus in re.finditer(r"-\s*([.0-9]+)", split):
        before = split[:minus.start()].rstrip()
        if not before or before[-1] not in ".0123456789":  # not "98-2" (a '-' separator)
            raise ValueError(f"--split {split!r}: the weight -{minus.group(1)} is negative; "
                             "split weights must be >= 0")
    if not _SPLIT_FORM.fullmatch(split):
        raise ValueError(f"--split {split!r}: expected one to three non-negative numbers (train, valid, test "
                         "weights) separated by ',' or '/', e.g. '969,30,1', '98,2' or '1'")
    values = [float(token) for token in re.findall(_SPLIT_NUMBER, split)]
    if len(values) > len(Split):
        raise ValueError(f"--split {split!r}: expected at most {len(Split)} numbers (train, valid, test)")
    values += [0.0] * (len(Split) - len(values))
    if sum(values) <= 0:
        raise ValueError(f"--split {split!r}: the split weights must not all be zero")
    return normalize(values)


def convert_split_vector_to_split_matrix(
    vector_a: Sequence[float], vector_b: Optional[Sequence[float]] = None
) -> List[Optional[Tuple[float, float]]]:
    """Turn split fractions into per-split ``(begin, end)`` book-ends, ``None`` for a zero-width split.

    ``[0.99, 0.01, 0.0] -> [(0, 0.99), (0.99, 1.0), None]``. With ``vector_b`` the result is the overlap
    of the two book-end lists (used when re-splitting). The cumulative sums start at the int 0 and add
    in order, so the floats (and the JSON of cache descriptions) match Megatron's exactly.
    """
    if vector_b is None:
        vector_b = vector_a

    def bookends(vector):
        edges = [0]
        for fraction in vector:
            edges.append(edges[-1] + fraction)
        return list(zip(edges[:-1], edges[1:]))

    matrix: List[Optional[Tuple[float, float]]] = []
    for (a_lo, a_hi), (b_lo, b_hi) in zip(bookends(vector_a), bookends(vector_b)):
        lo, hi = max(a_lo, b_lo), min(a_hi, b_hi)
        matrix.append(None if hi <= lo else (lo, hi))
    return matrix
