"""Read and write Megatron's indexed token datasets: a `.bin` of raw token ids and its `.idx` index.

File format (little-endian, no padding between arrays), as written by Megatron-LM:

    .idx = b"MMIDIDX\\x00\\x00" | u64 version (1) | u8 dtype code | u64 sequence_count N
           | u64 document_count (D+1) | int32[N] sequence_lengths | int64[N] sequence_pointers
           | int64[D+1] document_indices | (int8[N] sequence_modes, multimodal only)
    .bin = every sequence's token ids back to back, in the dtype named by the code

A *sequence* is the unit GPTDataset samples from; a *document* is a run of sequences
(``document_indices[d]`` to ``document_indices[d+1]``).
"""
from __future__ import annotations

import os
import struct
from enum import Enum
from typing import Optional, Sequence, Union

import numpy

_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_INDEX_VERSION = 1
_HEADER_SIZE = len(_INDEX_MAGIC) + 8 + 1 + 8 + 8  # 34 bytes


class DType(Enum):
    """Token dtype codes stored in byte 17 of the `.idx` header."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, value) -> int:
        """numpy dtype (or type) -> code. Raises ValueError for a dtype the format cannot store."""
        try:
            return cls[numpy.dtype(value).name].value
        except KeyError:
            raise ValueError(f"dtype {numpy.dtype(value)} cannot be stored in an indexed dataset") from None

    @classmethod
    def dtype_from_code(cls, value: int) -> type:
        """code -> numpy scalar type. Raises ValueError for an unknown code."""
        try:
            return getattr(numpy, cls(value).name)
        except ValueError:
            raise ValueError(f"unknown dtype code {value} in indexed dataset header") from None

    @staticmethod
    def size(key) -> int:
        """Bytes per token for a code or a numpy dtype."""
        if isinstance(key, int):
            return numpy.dtype(DType.dtype_from_code(key)).itemsize
        return numpy.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: Optional[int]) -> type:
        """Smallest dtype Megatron's preprocessing uses for a vocabulary: uint16 below 65,500 ids, else int32."""
        if cardinality is not None and cardinality < 65500:
            return numpy.uint16
        return numpy.int32


def get_idx_path(path_prefix: str) -> str:
    """`{prefix}.idx`."""
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    """`{prefix}.bin`."""
    return path_prefix + ".bin"


class _IndexReader:
    """Parses an `.idx` file into numpy views (memory-mapped, so opening is O(1) in the data size).

    Raises ValueError with the file name for a bad magic, version, or inconsistent counts.
    """

    def __init__(self, idx_path: str, multimodal: bool):
        with open(idx_path, "rb") as stream:
            header = stream.read(_HEADER_SIZE)
        if len(header) < _HEADER_SIZE or header[: len(_INDEX_MAGIC)] != _INDEX_MAGIC:
            raise ValueError(f"bad header, cannot read: {idx_path} (not a Megatron MMIDIDX index file)")
        version, code, sequence_count, document_count = struct.unpack("<QBQQ", header[len(_INDEX_MAGIC):])
        if version != _INDEX_VERSION:
            raise ValueError(f"bad version, cannot read: {idx_path} (version {version}, expected {_INDEX_VERSION})")
        self.dtype = DType.dtype_from_code(code)
        self.dtype_size = DType.size(code)
        self.sequence_count = sequence_count
        self.document_count = document_count

        expected = _HEADER_SIZE + 12 * sequence_count + 8 * document_count + (sequence_count if multimodal else 0)
        actual = os.path.getsize(idx_path)
        if actual < expected:
            raise ValueError(
                f"truncated index file {idx_path}: {actual} bytes, header promises {expected} "
                f"({sequence_count} sequences, {document_count} document boundaries)"
            )
        self._mmap = numpy.memmap(idx_path, mode="r", order="C")
        buf = self._mmap._mmap  # the raw mmap; frombuffer views avoid copying
        offset = _HEADER_SIZE
        self.sequence_lengths = numpy.frombuffer(buf, dtype=numpy.int32, count=sequence_count, offset=offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = numpy.frombuffer(buf, dtype=numpy.int64, count=sequence_count, offset=offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = numpy.frombuffer(buf, dtype=numpy.int64, count=document_count, offset=offset)
        offset += self.document_indices.nbytes
        self.sequence_modes = (
            numpy.frombuffer(buf, dtype=numpy.int8, count=sequence_count, offset=offset) if multimodal else None
        )
        if document_count < 1 or self.document_indices[-1] != sequence_count:
            raise ValueError(
                f"inconsistent index file {idx_path}: document_indices ends at "
                f"{self.document_indices[-1] if document_count else 'nothing'} but sequence_count is {sequence_count}"
            )


class IndexedDataset:
    """Random access to the token sequences of a `{prefix}.bin/.idx` pair.

    Args:
        path_prefix: the path without `.bin`/`.idx`.
        multimodal: the index also holds int8 sequence modes (no flag in the file says so).
        mmap: memory-map the `.bin` (default); otherwise read sequences with file reads.

    ``dataset[i]`` is sequence ``i`` as a 1-D numpy array of the stored dtype;
    ``get(i, offset, length)`` reads part of one. ``len(dataset)`` is the number of sequences.

    Raises:
        FileNotFoundError: a file of the pair is missing (names it).
        ValueError: a corrupt index, or a `.bin` whose size does not match the index.
    """

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True):
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset file not found: {path} (data prefix {path_prefix!r})")
        self.index = _IndexReader(idx_path, multimodal)
        lengths, pointers = self.index.sequence_lengths, self.index.sequence_pointers
        expected = int(pointers[-1]) + int(lengths[-1]) * self.index.dtype_size if len(lengths) else 0
        actual = os.path.getsize(bin_path)
        if actual != expected:
            raise ValueError(
                f"{bin_path} does not match {idx_path}: it has {actual} bytes but the index describes {expected}"
            )
        if mmap and actual > 0:
            self._bin = numpy.memmap(bin_path, mode="r", order="C")
            self._bin_buffer = self._bin._mmap
        else:
            self._bin = None
            self._bin_buffer = None

    # Pickling (DataLoader workers) reopens the files instead of shipping the maps.
    def __getstate__(self):
        return (self.path_prefix, self.multimodal, self.mmap)

    def __setstate__(self, state):
        self.__init__(*state)

    @property
    def dtype(self) -> type:
        """numpy scalar type of the tokens."""
        return self.index.dtype

    @property
    def sequence_lengths(self) -> numpy.ndarray:
        """int32 [N]: tokens per sequence."""
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> numpy.ndarray:
        """int64 [N]: byte offset of each sequence in the `.bin`."""
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> numpy.ndarray:
        """int64 [D+1]: first sequence of each document; the last entry is N."""
        return self.index.document_indices

    @property
    def sequence_modes(self) -> Optional[numpy.ndarray]:
        """int8 [N] modes of a multimodal dataset, else None."""
        return self.index.sequence_modes

    def __len__(self) -> int:
        return self.index.sequence_count

    def __getitem__(self, idx: int) -> numpy.ndarray:
        if isinstance(idx, (int, numpy.integer)):
            return self.get(int(idx))
        raise TypeError(f"IndexedDataset indices must be integers, got {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> numpy.ndarray:
        """Tokens ``[offset, offset+length)`` of sequence ``idx`` (to its end when length is None).

        Raises IndexError for a sequence or range outside the dataset.
        """
        n = self.index.sequence_count
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {self.path_prefix} ({n} sequences)")
        seq_len = int(self.index.sequence_lengths[idx])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"range [{offset}, {offset + length}) outside sequence {idx} of length {seq_len}")
        start = int(self.index.sequence_pointers[idx]) + offset * self.index.dtype_size
        if self._bin_buffer is not None:
            return numpy.frombuffer(self._bin_buffer, dtype=self.index.dtype, count=length, offset=start)
        with open(get_bin_path(self.path_prefix), "rb") as stream:
            stream.seek(start)
            return numpy.frombuffer(stream.read(length * self.index.dtype_size), dtype=self.index.dtype)

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """True when both `{prefix}.idx` and `{prefix}.bin` exist."""
        return os.path.isfile(get_idx_path(path_prefix)) and os.path.isfile(get_bin_path(path_prefix))


# Sequences of ints, numpy arrays or torch tensors (torch is not imported: preprocessing starts faster).
TokenSequence = Union[Sequence[int], numpy.ndarray]


def _as_numpy(tokens: TokenSequence, dtype) -> numpy.ndarray:
    if hasattr(tokens, "detach"):  # a torch tensor, possibly on a GPU
        tokens = tokens.detach().cpu().numpy()
    return numpy.asarray(tokens, dtype=dtype)


class IndexedDatasetBuilder:
    """Streams sequences into a `.bin` and writes the matching `.idx` at ``finalize``.

    Memory holds only the per-sequence lengths and document boundaries, never the tokens.

    Args:
        bin_path: the `.bin` file to create (truncated if present).
        dtype: numpy token dtype (Megatron's default is int32; preprocessing picks
            ``DType.optimal_dtype(vocab_size)``).
        multimodal: also record an int8 mode per sequence.
    """

    def __init__(self, bin_path: str, dtype=numpy.int32, multimodal: bool = False):
        self.bin_path = bin_path
        self.dtype = numpy.dtype(dtype)
        DType.code_from_dtype(self.dtype)  # fail early on an unstorable dtype
        self.multimodal = multimodal
        self._stream = open(bin_path, "wb")
        self.sequence_lengths: list = []
        self.document_indices: list = [0]
        self.sequence_modes: Optional[list] = [] if multimodal else None

    def add_item(self, tokens: TokenSequence, mode: int = 0) -> None:
        """Append one sequence (token ids) to the current document."""
        array = _as_numpy(tokens, self.dtype)
        self._stream.write(array.tobytes(order="C"))
        self.sequence_lengths.append(array.size)
        if self.multimodal:
            self.sequence_modes.append(mode)

    def add_document(self, tokens: TokenSequence, lengths: Sequence[int], modes: Optional[Sequence[int]] = None) -> None:
        """Append a whole document: ``tokens`` holds its sequences back to back, ``lengths`` their sizes.

        Raises ValueError if ``sum(lengths)`` differs from the number of tokens.
        """
        array = _as_numpy(tokens, self.dtype)
        if int(sum(lengths)) != array.size:
            raise ValueError(f"document lengths sum to {sum(lengths)} but {array.size} tokens were given")
        self._stream.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(int(n) for n in lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.multimodal:
            self.sequence_modes.extend(modes if modes is not None else [0] * len(lengths))

    def add_documents(self, tokens: TokenSequence, sequence_lengths: Sequence[int],
                      sequences_per_document: Sequence[int]) -> None:
        """Append many documents at once (what ``add_document`` does per document, in bulk).

        ``tokens`` holds all their sequences back to back, ``sequence_lengths`` [S] each sequence's size
        and ``sequences_per_document`` [D] how many of those sequences each document has (0 for an
        empty document). Raises ValueError if the lengths do not add up to the tokens or the
        per-document counts to the sequences.
        """
        array = numpy.ascontiguousarray(_as_numpy(tokens, self.dtype))
        lengths = numpy.asarray(sequence_lengths, dtype=numpy.int64)
        per_document = numpy.asarray(sequences_per_document, dtype=numpy.int64)
        if int(lengths.sum()) != array.size:
            raise ValueError(f"sequence lengths sum to {int(lengths.sum())} but {array.size} tokens were given")
        if int(per_document.sum()) != lengths.size:
            raise ValueError(f"documents hold {int(per_document.sum())} sequences but {lengths.size} lengths were given")
        self._stream.write(array.data)
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(lengths.tolist())
        self.document_indices.extend((offset + numpy.cumsum(per_document)).tolist())
        if self.multimodal:
            self.sequence_modes.extend([0] * lengths.size)

    def end_document(self) -> None:
        """Close the current document at the last added sequence."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append every sequence and document of another dataset (copies its `.bin` bytes verbatim).

        Raises ValueError if its token dtype differs from this builder's.
        """
        index = _IndexReader(get_idx_path(path_prefix), self.multimodal)
        if numpy.dtype(index.dtype) != self.dtype:
            raise ValueError(
                f"cannot merge {path_prefix}: its tokens are {numpy.dtype(index.dtype)}, this dataset's are {self.dtype}"
            )
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(index.sequence_lengths.tolist())
        self.document_indices.extend((offset + index.document_indices[1:]).tolist())
        if self.multimodal:
            self.sequence_modes.extend(index.sequence_modes.tolist())
        with open(get_bin_path(path_prefix), "rb") as source:
            while True:
                chunk = source.read(1 << 24)
                if not chunk:
                    break
                self._stream.write(chunk)

    def finalize(self, idx_path: str) -> None:
        """Close the `.bin` and write the `.idx`."""
        self._stream.close()
        lengths = numpy.asarray(self.sequence_lengths, dtype=numpy.int32)
        pointers = numpy.zeros(len(lengths), dtype=numpy.int64)
        if len(lengths) > 1:
            numpy.cumsum(lengths[:-1].astype(numpy.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = numpy.asarray(self.document_indices, dtype=numpy.int64)
        with open(idx_path, "wb") as stream:
            stream.write(_INDEX_MAGIC)
            stream.write(struct.pack("<QBQQ", _INDEX_VERSION, DType.code_from_dtype(self.dtype), len(lengths), len(documents)))
            stream.write(lengths.tobytes(order="C"))
            stream.write(pointers.tobytes(order="C"))
            stream.write(documents.tobytes(order="C"))
            if self.multimodal:
                stream.write(numpy.asarray(self.sequence_modes, dtype=numpy.int8).tobytes(order="C"))
