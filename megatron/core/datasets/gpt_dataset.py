"""GPT pretraining samples: shuffled fixed-length windows over a split's token sequences, with cached index arrays."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split, is_cache_builder, log_single_rank, save_atomically

logger = logging.getLogger(__name__)

_PAD_TOKEN_ID = -1

# Megatron's threshold: the last epoch gets its own shuffle when it contributes fewer than this
# fraction of an epoch's samples, so those few samples are not spread across the whole run.
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


@dataclass
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    """BlendedMegatronDatasetConfig plus the GPT sample options.

    Attributes:
        reset_position_ids: positions restart at 0 after every EOD in the input (``--reset-position-ids``).
        reset_attention_mask: tokens after an EOD cannot attend across it (``--reset-attention-mask``).
        eod_mask_loss: zero the loss where the input token is EOD (``--eod-mask-loss``).
        create_attention_mask: include ``attention_mask`` in samples
            (``--no-create-attention-mask-in-dataloader`` turns it off).
        drop_last_partial_validation_sequence: floor (not ceil) the valid split's sample count.
        add_extra_token_to_sequence: read S+1 tokens per sample so labels are the next tokens
            (always True in pretrain_gpt).
        vocab_size: the model's (padded) vocabulary; when set, a sample holding a token id outside
            ``[0, vocab_size)`` raises ValueError naming the ``.bin`` file, the id and the vocabulary
            instead of failing later inside the embedding. The check is a max/min over the sample's
            S+1 tokens in the loader (no device sync), so it costs nothing measurable; it reports the
            first bad sample a rank reads, not a scan of the whole file at start-up.

    Raises:
        ValueError: no tokenizer, or the tokenizer has no EOD id while an option needs one.
    """

    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = True
    drop_last_partial_validation_sequence: bool = True
    add_extra_token_to_sequence: bool = True
    vocab_size: Optional[int] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokenizer is None:
            raise ValueError("GPTDatasetConfig needs a tokenizer (its eod id and unique_identifiers are used)")
        needs_eod = self.mock or self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss
        if needs_eod and getattr(self.tokenizer, "eod", None) is None:
            raise ValueError(
                f"tokenizer {type(self.tokenizer).__name__} has no eod id, which --mock-data, --reset-position-ids, "
                "--reset-attention-mask and --eod-mask-loss need"
            )


def build_document_index(
    documents: numpy.ndarray, num_epochs: int, numpy_random_state: numpy.random.RandomState, separate_final_epoch: bool
) -> numpy.ndarray:
    """The split's sequence ids repeated ``num_epochs`` times (epoch-major), shuffled in place.

    With ``separate_final_epoch`` the first E-1 epochs and the last epoch are shuffled separately
    (two draws from ``numpy_random_state``, in that order).

    Returns:
        int32 [num_epochs * len(documents)].
    """
    if not separate_final_epoch or num_epochs == 1:
        document_index = numpy.tile(numpy.asarray(documents, dtype=numpy.int32), num_epochs)
        numpy_random_state.shuffle(document_index)
        return document_index
    first = build_document_index(documents, num_epochs - 1, numpy_random_state, False)
    last = build_document_index(documents, 1, numpy_random_state, False)
    return numpy.concatenate((first, last))


def build_shuffle_index(
    num_samples: int, total_size: int, numpy_random_state: numpy.random.RandomState
) -> numpy.ndarray:
    """A permutation of ``[0, total_size)`` that keeps ``[0, num_samples)`` and the rest apart.

    Returns:
        uint32 [total_size] (int64 when total_size >= 2**32 - 2): shuffle of ``arange(num_samples)``
        followed, if ``num_samples < total_size``, by a separate shuffle of ``arange(num_samples, total_size)``.
    """
    dtype = numpy.uint32 if total_size < numpy.iinfo(numpy.uint32).max - 1 else numpy.int64
    first = numpy.arange(0, num_samples, dtype=dtype)
    numpy_random_state.shuffle(first)
    if num_samples == total_size:
        return first
    last = numpy.arange(num_samples, total_size, dtype=dtype)
    numpy_random_state.shuffle(last)
    return numpy.concatenate((first, last))


def build_sample_index(
    sequence_lengths: numpy.ndarray,
    document_index: numpy.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: bool = True,
) -> numpy.ndarray:
    """Where each sample starts in the shuffled token stream (Megatron's ``helpers.build_sample_idx``).

    The stream is the sequences of ``document_index`` back to back. Sample j covers stream tokens
    ``[j*S, j*S + S + X)`` (X = add_extra_token_to_sequence), so consecutive samples share X tokens.
    Row j is ``(position in document_index, token offset in that sequence)`` of sample j's start as the
    reference's sequential walk records it: row 0 is ``(0, 0)``; row j >= 1 lies in the first stream
    position whose end reaches ``j*S + X`` (so with X = 0 a boundary start is recorded as the previous
    sequence at offset = its length, and empty sequences are skipped); a row past the end of the stream
    (only with ``drop_last_partial_sequence=False``) is ``(last, len(last) - X)``. Computed with a
    cumulative sum and ``searchsorted`` instead of a per-sample loop.

    Args:
        sequence_lengths: int32 [N] tokens per low-level sequence.
        document_index: int32 [M] shuffled sequence ids (see ``build_document_index``).
        sequence_length: S.
        num_epochs: E; ``num_epochs * tokens_per_epoch`` must equal the stream length.
        tokens_per_epoch: T.
        drop_last_partial_sequence: floor ``(E*T - X) / S`` samples, else ceil (in float32, as the reference).

    Returns:
        int32 [num_samples + 1, 2] (int64 when ids or lengths exceed int32).

    Raises:
        ValueError: the stream length differs from ``num_epochs * tokens_per_epoch``, or it is empty.
    """
    extra = int(bool(add_extra_token_to_sequence))
    total = int(num_epochs) * int(tokens_per_epoch)
    if drop_last_partial_sequence:
        num_samples = (total - extra) // sequence_length
    else:
        # The reference computes ceil(float(E*T - X) / S) in single precision; do the same.
        num_samples = int(numpy.ceil(numpy.float32(total - extra) / numpy.float32(sequence_length)))
    num_samples = max(num_samples, 0)

    doc_lengths = numpy.asarray(sequence_lengths)[document_index].astype(numpy.int64)
    if doc_lengths.size == 0:
        raise ValueError("cannot build a sample index from an empty document index")
    ends = numpy.cumsum(doc_lengths)
    if int(ends[-1]) != total:
        raise ValueError(f"document index holds {int(ends[-1])} tokens but num_epochs * tokens_per_epoch = {total}")

    starts = numpy.arange(1, num_samples + 1, dtype=numpy.int64) * sequence_length
    positions = numpy.searchsorted(ends, starts + extra, side="left")
    past_end = positions >= len(ends)
    positions = numpy.minimum(positions, len(ends) - 1)
    offsets = starts - (ends[positions] - doc_lengths[positions])
    offsets[past_end] = doc_lengths[-1] - extra

    largest = max(len(document_index), int(numpy.max(sequence_lengths)) if len(sequence_lengths) else 0)
    dtype = numpy.int32 if largest <= numpy.iinfo(numpy.int32).max else numpy.int64
    sample_index = numpy.empty((num_samples + 1, 2), dtype=dtype)
    sample_index[0] = 0
    sample_index[1:, 0] = positions
    sample_index[1:, 1] = offsets
    return sample_index


def get_ltor_masks_and_position_ids(
    data: torch.Tensor,
    eod_token: Optional[int],
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool,
) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Left-to-right attention mask, loss mask and position ids for one sample's input tokens.

    Args:
        data: int64 [S] input tokens.
        eod_token: the EOD id (needed only by the reset/eod options).

    Returns:
        attention_mask: bool [1, S, S], True = masked (a future position, or with ``reset_attention_mask``
            a position at or before an EOD that precedes the query), or None when not created.
        loss_mask: float32 [S], 1.0, with 0.0 where the input is EOD if ``eod_mask_loss``.
        position_ids: int64 [S], ``0..S-1``, restarting at 0 after each EOD if ``reset_position_ids``.
    """
    seq_length = data.numel()
    arange = torch.arange(seq_length, dtype=torch.long, device=data.device)
    is_eod = (data == eod_token) if eod_token is not None else torch.zeros_like(data, dtype=torch.bool)

    loss_mask = torch.ones(seq_length, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0

    position_ids = arange.clone()
    if reset_position_ids:
        # A segment starts right after each EOD; the start of position p's segment is the largest
        # (eod index + 1) strictly before p.
        after_eod = torch.where(is_eod, arange + 1, torch.zeros_like(arange))
        previous = torch.cat([after_eod.new_zeros(1), after_eod[:-1]])
        segment_start = torch.cummax(previous, dim=0).values
        position_ids = arange - segment_start

    attention_mask = None
    if create_attention_mask:
        allowed = arange.unsqueeze(1) >= arange.unsqueeze(0)  # [query, key]: key not in the future
        if reset_attention_mask:
            # Segment id = number of EODs strictly before the position; attention stays inside a segment.
            segment = torch.cumsum(is_eod.long(), dim=0) - is_eod.long()
            allowed &= segment.unsqueeze(1) == segment.unsqueeze(0)
        attention_mask = (~allowed).unsqueeze(0)
    return attention_mask, loss_mask, position_ids


def _resolve_pad_token_id(tokenizer: Any) -> int:
    """tokenizer.pad when it is a real id distinct from the EOD/BOS/EOS/special ids, else -1."""
    def read(name):
        # Tokenizers from other libraries raise for special tokens they do not define.
        try:
            return getattr(tokenizer, name, None)
        except (AttributeError, NotImplementedError, ValueError):
            return None

    pad = read("pad")
    if pad is None or int(pad) < 0:
        return _PAD_TOKEN_ID
    special = {read(name) for name in ("eod", "eos", "bos", "cls", "sep", "mask")}
    special.update(read("additional_special_tokens_ids") or [])
    if int(pad) in {int(s) for s in special if s is not None}:
        return _PAD_TOKEN_ID
    return int(pad)


class GPTDataset(MegatronDataset):
    """Fixed-length GPT samples drawn from one split of a low-level token dataset.

    Index arrays are built as in Megatron-LM's ``GPTDataset`` (see ``_build_document_sample_shuffle_indices``)
    and cached as ``{md5}-GPTDataset-{split}-{document_index,sample_index,shuffle_index}.npy`` plus
    ``description.txt``.

    Args:
        indexed_dataset: ``IndexedDataset`` (or mock) with ``sequence_lengths`` and ``get``.
        dataset_path: its path prefix (None for mock data).
        indexed_indices: int32 [n] sequence ids of this split.
        num_samples: samples requested (None = one epoch).
        index_split: the split.
        config: ``GPTDatasetConfig``.

    ``dataset[i]`` is a dict of tensors: ``tokens`` int64 [S], ``labels`` int64 [S], ``loss_mask`` float32 [S],
    ``attention_mask`` bool [1, S, S] (unless ``create_attention_mask`` is False), ``position_ids`` int64 [S].

    Raises:
        ValueError: samples requested from a split that holds no tokens, or a negative num_samples.
        RuntimeError: a rank other than 0 finds no cache (rank 0 must build first; use the builder).
    """

    def __init__(
        self,
        indexed_dataset: Any,
        dataset_path: Optional[str],
        indexed_indices: numpy.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        if num_samples is not None and num_samples < 0:
            raise ValueError(f"num_samples must be >= 0 or None, got {num_samples} for the {index_split.name} split")
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)

        self.masks_and_position_ids_are_cacheable = not any(
            [config.reset_position_ids, config.reset_attention_mask, config.eod_mask_loss]
        )
        self.masks_and_position_ids_are_cached = False
        self.cached_attention_mask: Optional[torch.Tensor] = None
        self.cached_loss_mask: Optional[torch.Tensor] = None
        self.cached_position_ids: Optional[torch.Tensor] = None
        self._pad_token_id = _resolve_pad_token_id(config.tokenizer)

        self.document_index, self.sample_index, self.shuffle_index = self._build_document_sample_shuffle_indices()

    def _extra_identifiers(self) -> Dict[str, Any]:
        # Options that change the arrays join the description only when off their default, so the
        # default description (and md5) stays identical to Megatron's.
        extra: Dict[str, Any] = {}
        if not self.config.add_extra_token_to_sequence:
            extra["add_extra_token_to_sequence"] = False
        if self.index_split == Split.valid and not self.config.drop_last_partial_validation_sequence:
            extra["drop_last_partial_validation_sequence"] = False
        return extra

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        """Number of sequences (the unit the split fractions and shuffles apply to)."""
        return int(low_level_dataset.sequence_lengths.shape[0])

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        """Open ``{dataset_path}.bin/.idx``.

        Raises:
            FileNotFoundError: naming the data prefix when either file is missing.
        """
        if not IndexedDataset.exists(dataset_path):
            missing = [p for p in (get_idx_path(dataset_path), get_bin_path(dataset_path)) if not os.path.isfile(p)]
            raise FileNotFoundError(f"data prefix {dataset_path!r}: missing {', '.join(missing)}")
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def _check_token_ids(self, text: numpy.ndarray) -> None:
        """Raise ValueError (one line) if ``text`` holds an id outside ``[0, config.vocab_size)``."""
        high, low = int(text.max()), int(text.min())
        if high < self.config.vocab_size and low >= 0:
            return
        bad = high if high >= self.config.vocab_size else low
        source = getattr(self.dataset, "path_prefix", None) or self.dataset_path
        where = f"data file {get_bin_path(source)}" if source else f"{type(self).__name__}"
        raise ValueError(
            f"{where} holds token id {bad}, outside the model's vocabulary of {self.config.vocab_size} ids "
            "(the padded vocabulary of --tokenizer-type/--vocab-size); it was tokenised with a different "
            "tokenizer: preprocess it again with the model's tokenizer or fix the tokenizer flags"
        )

    def __getitem__(self, idx: Optional[int]) -> Dict[str, torch.Tensor]:
        """Sample ``idx`` (None = a padding sample whose loss mask is all zero)."""
        text, _ = self._query_document_sample_shuffle_indices(0 if idx is None else idx)
        if self.config.vocab_size is not None and len(text):
            self._check_token_ids(text)
        text = torch.from_numpy(text)
        if self.config.add_extra_token_to_sequence:
            tokens = text[:-1].contiguous()
            labels = text[1:].contiguous()
        else:
            tokens = text
            labels = torch.roll(text, shifts=-1, dims=0)
            labels[-1] = self._pad_token_id

        if self.masks_and_position_ids_are_cacheable and self.masks_and_position_ids_are_cached:
            attention_mask, loss_mask, position_ids = (
                self.cached_attention_mask, self.cached_loss_mask, self.cached_position_ids,
            )
        else:
            attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
                tokens,
                getattr(self.config.tokenizer, "eod", None),
                self.config.reset_position_ids,
                self.config.reset_attention_mask,
                self.config.eod_mask_loss,
                self.config.create_attention_mask,
            )
            if self.masks_and_position_ids_are_cacheable:
                self.cached_attention_mask, self.cached_loss_mask, self.cached_position_ids = (
                    attention_mask, loss_mask, position_ids,
                )
                self.masks_and_position_ids_are_cached = True
        # The cached loss mask is shared between samples; the per-sample pad masking must not leak into it.
        loss_mask = loss_mask.clone()
        loss_mask[labels == self._pad_token_id] = 0.0
        # Pad ids (-1 by default) must not reach the embedding lookup.
        tokens[tokens == self._pad_token_id] = 0
        labels[labels == self._pad_token_id] = 0
        if idx is None:
            loss_mask.zero_()

        sample = {"tokens": tokens, "labels": labels}
        if self.config.create_attention_mask:
            sample["attention_mask"] = attention_mask
        sample["loss_mask"] = loss_mask
        sample["position_ids"] = position_ids
        return sample

    def _query_document_sample_shuffle_indices(self, idx: int) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """Tokens of sample ``idx`` and the sequence ids they came from.

        Returns:
            (int64 [S + X] tokens, padded with the pad id when the data ran out; int64 [k] sequence ids).

        Raises:
            IndexError: ``idx`` outside ``[0, len(self))``.
        """
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for the {self.index_split.name} split ({len(self)} samples)")
        extra = int(self.config.add_extra_token_to_sequence)
        target = self.config.sequence_length + extra
        j = int(self.shuffle_index[idx])
        doc_beg, offset_beg = (int(v) for v in self.sample_index[j])
        doc_end, offset_end = (int(v) for v in self.sample_index[j + 1])

        document_ids: List[int] = []
        parts: List[numpy.ndarray] = []
        for position in range(doc_beg, doc_end + 1):
            sequence_id = int(self.document_index[position])
            offset = offset_beg if position == doc_beg else 0
            length = offset_end + extra - offset if position == doc_end else None
            document_ids.append(sequence_id)
            parts.append(self.dataset.get(sequence_id, offset=offset, length=length))

        length = sum(len(part) for part in parts)
        if length < target:
            parts.append(numpy.full(target - length, self._pad_token_id, dtype=numpy.int64))
        return numpy.concatenate(parts).astype(numpy.int64, copy=False), numpy.array(document_ids, dtype=numpy.int64)

    def _get_num_tokens_per_epoch(self) -> int:
        """Tokens in this split's sequences (T)."""
        return int(numpy.sum(self.dataset.sequence_lengths[self.indices], dtype=numpy.int64))

    def _get_num_epochs(self, num_tokens_per_epoch: int) -> int:
        """Smallest E >= 1 with ``E*T >= num_samples*S + X`` (1 when num_samples is None).

        Raises:
            ValueError: samples were requested but the split holds no tokens.
        """
        if self.num_samples is None:
            return 1
        requested = self.num_samples * self.config.sequence_length + int(self.config.add_extra_token_to_sequence)
        if num_tokens_per_epoch <= 0 and self.num_samples == 0:
            return 1
        if num_tokens_per_epoch <= 0:
            raise ValueError(
                f"the {self.index_split.name} split of {self.dataset_path or 'the mock dataset'} holds no tokens "
                f"({len(self.indices)} sequences) but {self.num_samples} samples were requested; check --split"
            )
        return max(1, -(-requested // num_tokens_per_epoch))

    def _cache_paths(self) -> Optional[Dict[str, str]]:
        path_to_cache = self.config.path_to_cache
        if path_to_cache is None and not self.config.mock and self.dataset_path is not None:
            path_to_cache = os.path.join(self.dataset_path, "cache", f"{type(self).__name__}_indices")
        if not path_to_cache:
            return None
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
        return {
            name: os.path.join(path_to_cache, f"{base}-{name}")
            for name in ("description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy")
        }

    def _build_document_sample_shuffle_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        """Build (or load from cache) the document, sample and shuffle indices.

        Algorithm (Megatron-LM ``GPTDataset``): E epochs of the split's sequences; if E > 1 and the
        last epoch contributes fewer than ``int(0.8 * per_epoch)`` samples it is shuffled separately;
        one ``numpy.random.RandomState(seed)`` shuffles the document index, then the shuffle index.

        Returns:
            document_index int32 [E*n], sample_index [num_built+1, 2], shuffle_index uint32 [num_built].
        """
        paths = self._cache_paths()
        cache_hit = paths is not None and all(os.path.isfile(p) for p in paths.values())

        if paths is not None and not cache_hit and not is_cache_builder():
            raise RuntimeError(
                f"rank {torch.distributed.get_rank()}: no cached {type(self).__name__} {self.index_split.name} indices "
                f"in {os.path.dirname(paths['description.txt'])}; rank 0 builds them first "
                "(build datasets through BlendedMegatronDatasetBuilder, which synchronises the ranks)"
            )

        if cache_hit:
            log_single_rank(logger, logging.INFO, f"Load the {type(self).__name__} {self.index_split.name} indices")
            return tuple(
                numpy.load(paths[name], allow_pickle=False, mmap_mode="r")
                for name in ("document_index.npy", "sample_index.npy", "shuffle_index.npy")
            )

        log_single_rank(
            logger, logging.INFO, f"Build and save the {type(self).__name__} {self.index_split.name} indices"
        )
        self.built_anew_on_cache_miss = True
        t_beg = time.time()
        sequence_length = self.config.sequence_length
        extra = int(self.config.add_extra_token_to_sequence)
        num_tokens_per_epoch = self._get_num_tokens_per_epoch()
        num_epochs = self._get_num_epochs(num_tokens_per_epoch)

        separate_final_epoch = False
        if num_epochs > 1:
            num_samples_sans_final_epoch = ((num_epochs - 1) * num_tokens_per_epoch - extra) // sequence_length
            num_samples_from_final_epoch = self.num_samples - num_samples_sans_final_epoch
            num_samples_per_epoch = (num_tokens_per_epoch - extra) // sequence_length
            separate_final_epoch = num_samples_from_final_epoch < int(
                _SEPARATE_FINAL_EPOCH_THRESHOLD * num_samples_per_epoch
            )

        numpy_random_state = numpy.random.RandomState(self.config.random_seed)
        if num_tokens_per_epoch > 0:
            document_index = build_document_index(self.indices, num_epochs, numpy_random_state, separate_final_epoch)
            drop_last = True
            if self.index_split == Split.valid:
                drop_last = self.config.drop_last_partial_validation_sequence
            sample_index = build_sample_index(
                self.dataset.sequence_lengths, document_index, sequence_length, num_epochs,
                num_tokens_per_epoch, drop_last, self.config.add_extra_token_to_sequence,
            )
        else:
            # An empty split with nothing requested (num_samples None or 0) is an empty dataset.
            document_index = build_document_index(self.indices, 1, numpy_random_state, False)
            sample_index = numpy.zeros((1, 2), dtype=numpy.int32)

        num_built = sample_index.shape[0] - 1
        if separate_final_epoch:
            shuffle_index = build_shuffle_index(num_samples_sans_final_epoch, num_built, numpy_random_state)
        else:
            shuffle_index = build_shuffle_index(num_built, num_built, numpy_random_state)

        if paths is not None:
            os.makedirs(os.path.dirname(paths["description.txt"]), exist_ok=True)
            save_atomically(paths["document_index.npy"], document_index)
            save_atomically(paths["sample_index.npy"], sample_index)
            save_atomically(paths["shuffle_index.npy"], shuffle_index)
            # Written last: a description without its arrays never exists, so a crash leaves a miss.
            save_atomically(paths["description.txt"], self.unique_description)

        log_single_rank(
            logger, logging.DEBUG,
            f"\t{type(self).__name__} {self.index_split.name}: {num_epochs} epochs, {num_built} samples, "
            f"separate final epoch {separate_final_epoch}, built in {time.time() - t_beg:.4f} s",
        )
        return document_index, sample_index, shuffle_index


class MockGPTLowLevelDataset:
    """In-memory stand-in for an IndexedDataset (``--mock-data``).

    100,000 sequences with lengths ``numpy.random.default_rng(0).integers(1, 4096, dtype=int32)``;
    sequence k is ``[(1 .. len-1) % vocab_size] + [eod]``.

    Args:
        tokenizer: provides ``eod`` and ``vocab_size``.
    """

    seed: int = 0
    size: int = 100000
    max_sequence_length: int = 4096

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(tokenizer.vocab_size)
        self.eod = int(tokenizer.eod)
        rng = numpy.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(
            low=1, high=self.max_sequence_length, size=self.size, dtype=numpy.int32
        )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> numpy.ndarray:
        length = int(self.sequence_lengths[idx])
        body = numpy.arange(1, length, dtype=numpy.int64) % self.vocab_size
        return numpy.concatenate([body, numpy.array([self.eod], dtype=numpy.int64)])

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> numpy.ndarray:
        """Tokens ``[offset, offset+length)`` of sequence ``idx`` (to its end when length is None)."""
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self[idx][offset : offset + length]


class MockGPTDataset(GPTDataset):
    """GPTDataset over ``MockGPTLowLevelDataset`` (same index logic; cached only under ``--data-cache-path``).

    Raises:
        ValueError: the config is not in mock mode.
    """

    def __init__(
        self,
        dataset: MockGPTLowLevelDataset,
        dataset_path: Optional[str],
        indices: numpy.ndarray,
        num_samples: Optional[int],
        index_split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        if not config.mock:
            raise ValueError("MockGPTDataset needs a mock config (no --data-path / blend given)")
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: MockGPTLowLevelDataset) -> int:
        """Number of mock sequences."""
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: GPTDatasetConfig) -> MockGPTLowLevelDataset:
        """A fresh mock low-level dataset (``dataset_path`` is ignored)."""
        return MockGPTLowLevelDataset(config.tokenizer)
