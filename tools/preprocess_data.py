"""Tokenize a JSON-lines corpus into Megatron's indexed dataset files (`{prefix}_{key}_{level}.bin/.idx`).

Each input line is one JSON object; the text under every ``--json-keys`` key becomes one
document (without ``--split-sentences``: one sequence; with it: one sequence per non-empty
sentence). ``--append-eod`` adds the tokenizer's end-of-document id to the last sequence of each
non-empty document. Output is byte-identical to Megatron-LM's ``tools/preprocess_data.py``
whatever ``--workers`` is: documents keep input order.

Bad input policy. A line that is not UTF-8 JSON, is not a JSON object, lacks a key, holds a value
that is neither a string nor a list of strings (pre-split sentences), holds a lone surrogate
(``"\\ud800"``), or holds text the tokenizer rejects (a NullTokenizer id that is not an integer in
``[0, --vocab-size]``) is an error: the tool names the file and line, exits with status 1, and removes
its partial output (files are written under temporary names and renamed only on success). With
``--skip-bad-lines`` such lines are skipped, counted and reported at the end instead. Empty text
gives a document with zero sequences (as Megatron does). An input with no usable document is an
error. A tokenizer without an end-of-document id is refused with ``--append-eod`` before any work.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import math
import multiprocessing
import os
import queue as queue_module
import shutil
import sys
import tempfile
import time
import zlib
from concurrent.futures import Executor
from concurrent.futures.process import BrokenProcessPool, ProcessPoolExecutor
from typing import Dict, List, NamedTuple, Optional, Tuple

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

import numpy  # noqa: E402

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    DType,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)
from megatron.training.tokenizer import add_tokenizer_args, build_tokenizer  # noqa: E402

try:  # several times faster than json on the common lines; anything it refuses goes through json
    from orjson import loads as _fast_loads
except ImportError:
    _fast_loads = json.loads

# Megatron splits texts longer than this many characters before sentence splitting.
_SENTENCE_SPLIT_CHUNK = 1_000_000
# Input bytes per batch, the unit of work of a worker: large enough that per-batch costs (tokenizer
# calls, the executor's bookkeeping) fade (the parent's share of the CPU time with 2 workers is ~11%
# at 128 KB, ~9% at 256 KB, ~8% at 512 KB), small enough that two workers share a 1 MB file.
_BATCH_BYTES = 1 << 18
# Bad lines named in the final report under --skip-bad-lines (the rest are only counted).
_SKIPPED_EXAMPLES = 20


class PreprocessError(Exception):
    """A user-facing failure: bad input, bad flags or a missing dependency."""


# --------------------------------------------------------------------------------------------
# Sentence splitting (NLTK punkt)


def _build_sentence_splitter(lang: str, keep_newlines: bool):
    """NLTK punkt splitter for ``lang``; with ``keep_newlines`` whitespace after a sentence end is kept.

    Raises PreprocessError if nltk or its punkt data is missing.
    """
    try:
        import nltk
        from nltk.tokenize import punkt
    except ImportError:
        raise PreprocessError(
            "--split-sentences needs the nltk package (pip install nltk) and its punkt data "
            "(python -m nltk.downloader punkt_tab)"
        ) from None
    try:
        if hasattr(punkt, "PunktTokenizer"):
            splitter = punkt.PunktTokenizer(lang)
        else:
            splitter = nltk.load(f"tokenizers/punkt/{lang}.pickle")
    except (LookupError, OSError, ValueError) as error:
        raise PreprocessError(
            f"--lang {lang}: NLTK punkt data not found ({error.__class__.__name__}); "
            "install it with python -m nltk.downloader punkt_tab"
        ) from None
    if not keep_newlines:
        return splitter

    class _NewlineKeepingVars(punkt.PunktLanguageVars):
        # Punkt normally requires whitespace (and swallows it) after a sentence end; letting the
        # end be followed by any whitespace run keeps newlines attached to the sentence.
        _period_context_fmt = r"""
            \S*
            %(SentEndChars)s
            \s*
            (?=(?P<after_tok>
                %(NonWord)s
                |
                (?P<next_tok>\S+)
            ))"""

    return punkt.PunktSentenceTokenizer(train_text=splitter._params, lang_vars=_NewlineKeepingVars())


# --------------------------------------------------------------------------------------------
# Encoding (runs in workers)


class EncodedBatch(NamedTuple):
    """What a worker returns for a batch of consecutive input lines.

    ``docs`` maps key -> ``(tokens [T] in the output dtype, sequence lengths [S], sequences per
    document [D])`` over the batch's good lines in order (D of them); ``errors`` lists
    ``(line_number, reason)`` of its bad lines; ``n_bytes`` counts all its input bytes.
    """

    n_bytes: int
    documents: int
    docs: Dict[str, Tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]]
    errors: List[Tuple[int, str]]


class Encoder:
    """Turns input lines into token ids per key; lives once per worker process.

    Args:
        tokenizer: a ``MegatronTokenizer``.
        json_keys: keys whose text is tokenized, each into its own output.
        append_eod: append ``tokenizer.eod`` to each non-empty document.
        dtype: numpy dtype of the output tokens.
        splitter: sentence splitter with ``.tokenize(text) -> list[str]`` or ``None``.
        splitter_spec: ``(lang, keep_newlines)`` that ``splitter`` was built from, or ``None``.

    A copy sent to a spawned or forkserver worker (pickled) leaves the splitter behind when
    ``splitter_spec`` is given and rebuilds it there on first use: NLTK splitters with Megatron's
    newline-keeping language variables do not pickle. Forked workers use the parent's as it is.
    """

    def __init__(self, tokenizer, json_keys: List[str], append_eod: bool, dtype, splitter=None,
                 splitter_spec: Optional[Tuple[str, bool]] = None) -> None:
        self.tokenizer = tokenizer
        self.json_keys = json_keys
        self.append_eod = append_eod
        self.dtype = numpy.dtype(dtype)
        self.splitter = splitter
        self.splitter_spec = splitter_spec

    def __getstate__(self):
        state = dict(self.__dict__)
        if self.splitter_spec is not None:
            state["splitter"] = None
        return state

    def _sentences(self, text) -> List[str]:
        if isinstance(text, list):
            return text
        if self.splitter is None and self.splitter_spec is not None:
            self.splitter = _build_sentence_splitter(*self.splitter_spec)
        if self.splitter is None:
            return [text]
        sentences: List[str] = []
        for start in range(0, len(text), _SENTENCE_SPLIT_CHUNK):
            sentences.extend(self.splitter.tokenize(text[start:start + _SENTENCE_SPLIT_CHUNK]))
        return sentences

    def parse(self, raw: bytes) -> Dict[str, object]:
        """Decode and validate one line. Raises ValueError with a message fit for ``file:line: ``."""
        try:
            data = json.loads(raw)
        except UnicodeDecodeError as error:
            raise ValueError(f"not UTF-8 ({error.reason} at byte {error.start})") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"not JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(data, dict):
            raise ValueError(f"not a JSON object (got {type(data).__name__})")
        texts = {}
        for key in self.json_keys:
            if key not in data:
                raise ValueError(f"missing key {key!r} (see --json-keys)")
            value = data[key]
            if isinstance(value, list) and all(isinstance(item, str) for item in value):
                pieces = value
            elif isinstance(value, str):
                pieces = [value]
            else:
                raise ValueError(f"key {key!r} holds {type(value).__name__}, expected a string")
            for piece in pieces:
                try:
                    piece.encode("utf-8")
                except UnicodeEncodeError as error:
                    raise ValueError(
                        f"key {key!r} holds a lone surrogate {piece[error.start]!r} at character {error.start}"
                    ) from None
            texts[key] = value
        return texts

    def encode_batch(self, batch: Tuple[int, List[bytes]]) -> EncodedBatch:
        """``(first line number, raw lines)`` -> their ``EncodedBatch``.

        Fast path, for batches of plain text (every line a JSON object holding a string under each
        key, no sentence splitting): each key's texts go to the tokenizer in one ``tokenize_many``
        call, the end-of-document ids are inserted and the dtype converted with numpy. Any other
        batch, or one whose text the tokenizer rejects, goes line by line through ``encode``, which
        validates and names the bad lines; both give the same tokens.
        """
        first_line, lines = batch
        n_bytes = sum(map(len, lines))
        texts = self._plain_texts(lines)
        if texts is not None:
            try:
                docs = {key: self._tokenize_documents(key_texts) for key, key_texts in texts.items()}
                return EncodedBatch(n_bytes, len(lines), docs, [])
            except ValueError:  # e.g. a NullTokenizer id out of range: encode() names the line
                pass
        return self._encode_lines(first_line, lines, n_bytes)

    def _plain_texts(self, lines: List[bytes]) -> Optional[Dict[str, List[str]]]:
        """key -> the lines' texts, or None unless the fast path of ``encode_batch`` applies to every line."""
        if self.splitter is not None or self.splitter_spec is not None:
            return None
        try:
            records = [_fast_loads(raw) for raw in lines]
            # KeyError: a missing key; TypeError: a line that is not a JSON object.
            texts = {key: [record[key] for record in records] for key in self.json_keys}
            for key_texts in texts.values():
                # TypeError: a value that is not a string; UnicodeEncodeError: a lone surrogate (orjson
                # refuses them, json does not; tokenizers should never see them).
                "".join(key_texts).encode("utf-8")
        except (ValueError, KeyError, TypeError):
            return None
        return texts

    def _tokenize_documents(self, texts: List[str]) -> Tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        """One document (one sequence, or none if empty) per text, with ``--append-eod`` applied."""
        ids, counts = self.tokenizer.tokenize_many(texts)
        non_empty = counts > 0
        if self.append_eod:
            ids = numpy.insert(ids, numpy.cumsum(counts)[non_empty], self.tokenizer.eod)
            counts = counts + non_empty
        return ids.astype(self.dtype, copy=False), counts[non_empty], non_empty.astype(numpy.int64)

    def _encode_lines(self, first_line: int, lines: List[bytes], n_bytes: int) -> EncodedBatch:
        tokens: Dict[str, List[numpy.ndarray]] = {key: [] for key in self.json_keys}
        lengths: Dict[str, List[int]] = {key: [] for key in self.json_keys}
        per_document: Dict[str, List[int]] = {key: [] for key in self.json_keys}
        errors: List[Tuple[int, str]] = []
        for line_number, raw in enumerate(lines, start=first_line):
            _, docs, _, error = self.encode((line_number, raw))
            if error is not None:
                errors.append((line_number, error))
                continue
            for key, (doc_tokens, doc_lengths) in docs.items():
                tokens[key].append(doc_tokens)
                lengths[key].extend(doc_lengths)
                per_document[key].append(len(doc_lengths))
        docs = {key: (numpy.concatenate(tokens[key]) if tokens[key] else numpy.zeros(0, self.dtype),
                      numpy.asarray(lengths[key], dtype=numpy.int64),
                      numpy.asarray(per_document[key], dtype=numpy.int64))
                for key in self.json_keys}
        return EncodedBatch(n_bytes, len(lines) - len(errors), docs, errors)

    def encode(self, item: Tuple[int, bytes]):
        """``(line_number, raw_line)`` -> ``(line_number, docs, n_bytes, error)``.

        ``docs`` maps key -> ``(tokens [n] in self.dtype, sequence lengths)``; on a bad line ``docs``
        is ``None`` and ``error`` says why (returned, not raised, so the parent reports lines in order).
        Text the tokenizer rejects (its ``ValueError``) is a bad line too.
        """
        line_number, raw = item
        try:
            texts = self.parse(raw)
        except ValueError as error:
            return line_number, None, len(raw), str(error)
        docs = {}
        for key, text in texts.items():
            doc_ids: List[int] = []
            lengths: List[int] = []
            for sentence in self._sentences(text):
                try:
                    sentence_ids = self.tokenizer.tokenize(sentence)
                except ValueError as error:  # text the tokenizer rejects, e.g. a NullTokenizer id out of range
                    return line_number, None, len(raw), f"key {key!r}: {error}"
                if sentence_ids:
                    doc_ids.extend(sentence_ids)
                    lengths.append(len(sentence_ids))
            if doc_ids and self.append_eod:
                doc_ids.append(self.tokenizer.eod)
                lengths[-1] += 1
            docs[key] = (numpy.asarray(doc_ids, dtype=self.dtype), lengths)
        return line_number, docs, len(raw), None


_WORKER_ENCODER: Optional[Encoder] = None


def _init_worker(encoder: Encoder) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder


def _encode_in_worker(batch):
    # A plain tuple: under spawn this module is __mp_main__ in the worker, and the parent could not
    # unpickle an instance of a class defined here.
    return tuple(_WORKER_ENCODER.encode_batch(batch))


def _encode_in_order(pool: Executor, batches, in_flight: int):
    """The encoded ``batches`` in input order, at most ``in_flight`` of them submitted ahead, so that
    memory stays flat however long the input is."""
    pending = collections.deque()
    for batch in batches:
        pending.append(pool.submit(_encode_in_worker, batch))
        if len(pending) >= in_flight:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


# --------------------------------------------------------------------------------------------
# Files


def _open_lines(path: str):
    """Binary line reader; ``.gz`` files are decompressed on the fly."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _batches(source):
    """``(first line number, lines)`` of consecutive lines, about ``_BATCH_BYTES`` at a time."""
    line_number = 1
    while True:
        lines = source.readlines(_BATCH_BYTES)
        if not lines:
            return
        yield line_number, lines
        line_number += len(lines)


def _output_prefix(output_prefix: str, key: str, level: str) -> str:
    return f"{output_prefix}_{key}_{level}"


def _temporary(path: str) -> str:
    return f"{path}.tmp{os.getpid()}"


def _remove_quietly(*paths: str) -> None:
    for path in paths:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


class _Outputs:
    """One builder per key, written under temporary names and renamed on ``commit``."""

    def __init__(self, output_prefix: str, keys: List[str], level: str, dtype) -> None:
        self.finals = {key: _output_prefix(output_prefix, key, level) for key in keys}
        self.temps = {key: {"bin": _temporary(get_bin_path(p)), "idx": _temporary(get_idx_path(p))}
                      for key, p in self.finals.items()}
        self.builders: Dict[str, IndexedDatasetBuilder] = {}
        try:
            for key in keys:
                self.builders[key] = IndexedDatasetBuilder(self.temps[key]["bin"], dtype=dtype)
        except OSError as error:
            self.abort()
            raise PreprocessError(f"--output-prefix {output_prefix}: cannot write output ({error})") from None

    def commit(self) -> None:
        for key, builder in self.builders.items():
            builder.finalize(self.temps[key]["idx"])
        for key, final in self.finals.items():
            os.replace(self.temps[key]["bin"], get_bin_path(final))
            os.replace(self.temps[key]["idx"], get_idx_path(final))

    def abort(self) -> None:
        for key, builder in self.builders.items():
            try:  # finalize is the builder's only way to close its stream; the result is deleted below
                builder.finalize(self.temps[key]["idx"])
            except OSError:
                pass
        for temps in self.temps.values():
            _remove_quietly(temps["bin"], temps["idx"])


class _Stats:
    def __init__(self, log_interval: int) -> None:
        self.log_interval = log_interval
        self.start = time.time()
        self.documents = 0
        self.bytes = 0
        self.skipped = 0
        self.skipped_examples: List[str] = []  # the first few only, so memory stays flat

    def add_documents(self, count: int) -> None:
        """Count ``count`` more documents; print a progress line for each multiple of the interval passed."""
        reported = self.documents // self.log_interval
        self.documents += count
        for multiple in range(reported + 1, self.documents // self.log_interval + 1):
            documents = multiple * self.log_interval
            elapsed = max(time.time() - self.start, 1e-9)
            print(f"Processed {documents} documents ({documents / elapsed:.2f} docs/s, "
                  f"{self.bytes / elapsed / 1024 / 1024:.2f} MB/s).", file=sys.stderr, flush=True)


def process_file(input_path: str, output_prefix: str, encoder: Encoder, workers: int, level: str,
                 log_interval: int = 1000, skip_bad_lines: bool = False, allow_empty: bool = False,
                 origin=None) -> _Stats:
    """Tokenize one JSON-lines file into ``{output_prefix}_{key}_{level}.bin/.idx`` for each key.

    Streams: lines are read lazily in batches of about ``_BATCH_BYTES`` and each batch's tokens go
    straight to the ``.bin``. With ``workers > 1`` batches are encoded by a process pool and
    written in input order, else encoded in this process. ``origin`` maps a line
    number of ``input_path`` to the ``file:line`` that bad-line messages name (default
    ``input_path:line``; a partition names the user's file it came from).

    Raises PreprocessError on a bad line (unless ``skip_bad_lines``), on an input with no
    usable document (unless ``allow_empty``: one partition of several may be empty), or when the
    input or output cannot be opened; nothing is left at the output paths then.
    """
    try:
        source = _open_lines(input_path)
    except OSError as error:
        raise PreprocessError(f"--input {input_path}: cannot open ({error.strerror})") from None
    try:
        outputs = _Outputs(output_prefix, encoder.json_keys, level, encoder.dtype)
    except BaseException:
        source.close()
        raise
    stats = _Stats(log_interval)
    if origin is None:
        origin = _SameFile(input_path)
    pool = None
    try:
        batches = _batches(source)
        if workers > 1:
            # Not multiprocessing.Pool: its worker-handler thread wakes on every result in the pipe and
            # spins while the result handler reads it, which cost the parent ~15% of the workers' CPU.
            pool = ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(encoder,))
            results = _encode_in_order(pool, batches, in_flight=2 * workers)
        else:
            results = map(encoder.encode_batch, batches)
        for n_bytes, documents, docs, errors in results:  # EncodedBatch fields
            stats.bytes += n_bytes
            for line_number, error in errors:
                if not skip_bad_lines:
                    raise PreprocessError(f"{origin(line_number)}: {error} "
                                          "(use --skip-bad-lines to skip such lines)")
                stats.skipped += 1
                if len(stats.skipped_examples) < _SKIPPED_EXAMPLES:
                    stats.skipped_examples.append(f"{origin(line_number)}: {error}")
            for key, (tokens, lengths, per_document) in docs.items():
                outputs.builders[key].add_documents(tokens, lengths, per_document)
            stats.add_documents(documents)
        if stats.documents == 0 and not allow_empty:
            raise PreprocessError(f"{input_path}: no usable document (empty input or every line was bad)")
        outputs.commit()
    except BaseException as error:
        outputs.abort()
        if isinstance(error, (gzip.BadGzipFile, EOFError, zlib.error)):
            raise PreprocessError(f"--input {input_path}: damaged gzip file ({error})") from None
        if isinstance(error, BrokenProcessPool):
            raise PreprocessError(f"--input {input_path}: a worker process died ({error}); out of memory? "
                                  "try fewer --workers") from None
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        source.close()
    return stats


# --------------------------------------------------------------------------------------------
# Inputs and outputs that must not meet


def _expand_inputs(pattern: str) -> List[str]:
    """The files ``--input`` names (a glob, expanded once, sorted), before anything is written.

    Raises PreprocessError if nothing matches or a match is not a file.
    """
    matches = sorted(glob.glob(pattern))
    if not matches:
        raise PreprocessError(f"--input {pattern}: no file matches")
    for path in matches:
        if not os.path.isfile(path):
            raise PreprocessError(f"--input {pattern}: matches {path}, which is not a file")
    return matches


def _refuse_overwriting_inputs(input_files: List[str], output_prefix: str, keys: List[str], level: str) -> None:
    """Raise PreprocessError naming both paths if an output file is one of the inputs (also via a link)."""
    identities = {}
    for path in input_files:
        info = os.stat(path)
        identities[(info.st_dev, info.st_ino)] = path
    for key in keys:
        final = _output_prefix(output_prefix, key, level)
        for output in (get_bin_path(final), get_idx_path(final)):
            try:
                info = os.stat(output)
            except FileNotFoundError:
                continue
            victim = identities.get((info.st_dev, info.st_ino))
            if victim is not None:
                raise PreprocessError(f"--output-prefix {output_prefix} would overwrite the input {victim} "
                                      f"(output file {output}); choose another --output-prefix")


class _SameFile:
    """Bad-line location ``path:line`` for a file read as it is."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, line_number: int) -> str:
        return f"{self.path}:{line_number}"


class _PartitionOrigin:
    """Bad-line location in the user's input for line ``k`` of partition ``index``.

    Lines were dealt to partitions round robin (global line ``(k - 1) * partitions + index``) or,
    with ``per_partition``, in blocks (global line ``index * per_partition + k - 1``); the global
    line is then found in the inputs from their line counts.
    """

    def __init__(self, input_files: List[str], line_counts: List[int], partitions: int, index: int,
                 per_partition: int) -> None:
        self.input_files, self.line_counts = input_files, line_counts
        self.partitions, self.index, self.per_partition = partitions, index, per_partition

    def __call__(self, line_number: int) -> str:
        if self.per_partition:
            position = self.index * self.per_partition + line_number - 1
        else:
            position = (line_number - 1) * self.partitions + self.index
        for path, count in zip(self.input_files, self.line_counts):
            if position < count:
                return f"{path}:{position + 1}"
            position -= count
        return f"partition {self.index} line {line_number}"  # unreachable while the counts are right


# --------------------------------------------------------------------------------------------
# Partitions


def _split_into_partitions(input_files: List[str], targets: List[str], keep_sequential: bool) -> Tuple[List[int], int]:
    """Distribute lines round robin, or in contiguous blocks with ``keep_sequential``.

    Returns (lines per input file, lines per block or 0 for round robin). Raises PreprocessError
    naming the input for a damaged gzip file.
    """
    def lines_of(path):
        try:
            with _open_lines(path) as source:
                yield from source
        except (gzip.BadGzipFile, EOFError, zlib.error) as error:
            raise PreprocessError(f"--input {path}: damaged gzip file ({error})") from None

    per_partition = 0
    if keep_sequential:
        total = sum(sum(1 for _ in lines_of(path)) for path in input_files)
        per_partition = max(1, math.ceil(total / len(targets)))
    counts = []
    sinks = [open(path, "wb") for path in targets]
    try:
        index = 0
        for path in input_files:
            start = index
            for line in lines_of(path):
                if not line.endswith(b"\n"):
                    line += b"\n"
                if keep_sequential:
                    sinks[index // per_partition].write(line)
                else:
                    sinks[index % len(sinks)].write(line)
                index += 1
            counts.append(index - start)
    finally:
        for sink in sinks:
            sink.close()
    return counts, per_partition


def _partition_main(queue, input_path, output_prefix, encoder, workers, level, log_interval, skip_bad_lines, origin):
    try:
        stats = process_file(input_path, output_prefix, encoder, workers, level, log_interval, skip_bad_lines,
                             allow_empty=True, origin=origin)
        queue.put((origin.index, None, stats.documents, stats.skipped, stats.skipped_examples))
    except PreprocessError as error:
        queue.put((origin.index, str(error), 0, 0, []))
    except BaseException as error:  # report anything, so the parent never waits on a dead child
        queue.put((origin.index, f"{type(error).__name__}: {error}", 0, 0, []))


def process_partitioned(args, encoder: Encoder, level: str) -> Tuple[int, int, List[str]]:
    """``--partitions N``: split the ``--input`` glob into N files, tokenize them in parallel, merge.

    The glob is expanded once, before anything is written. Partition inputs and per-partition
    outputs live in a private temporary folder next to the output prefix (the input folder may be
    read-only), removed at the end, also on failure: they never overwrite a user's file and are
    never read back as input. Each partition gets ``workers // partitions`` workers; the partition
    outputs are merged in partition order into ``{output_prefix}_{key}_{level}``. Returns
    (documents, skipped lines, the first few skipped lines as ``file:line: reason`` of the user's input).

    Raises PreprocessError if the glob matches nothing (or a folder), an output would overwrite an
    input, or a partition fails.
    """
    input_files = _expand_inputs(args.input)
    _refuse_overwriting_inputs(input_files, args.output_prefix, encoder.json_keys, level)
    output_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    try:
        scratch = tempfile.mkdtemp(prefix=f".{os.path.basename(args.output_prefix)}.partitions.", dir=output_dir)
    except OSError as error:
        raise PreprocessError(f"--output-prefix {args.output_prefix}: cannot write in {output_dir} "
                              f"({error.strerror})") from None
    processes = []
    try:
        partition_inputs = [os.path.join(scratch, f"partition_{i}.jsonl") for i in range(args.partitions)]
        line_counts, per_partition = _split_into_partitions(input_files, partition_inputs,
                                                            args.keep_sequential_samples)
        partition_prefixes = [os.path.join(scratch, f"partition_{i}") for i in range(args.partitions)]
        context = multiprocessing.get_context()
        queue = context.Queue()
        processes = [
            context.Process(target=_partition_main,
                            args=(queue, path, prefix, encoder, args.workers // args.partitions, level,
                                  args.log_interval, args.skip_bad_lines,
                                  _PartitionOrigin(input_files, line_counts, args.partitions, i, per_partition)))
            for i, (path, prefix) in enumerate(zip(partition_inputs, partition_prefixes))
        ]
        for process in processes:
            process.start()
        outcomes = []
        while len(outcomes) < len(processes):
            try:
                outcomes.append(queue.get(timeout=1.0))
            except queue_module.Empty:
                if not any(process.is_alive() for process in processes) and queue.empty():
                    codes = [process.exitcode for process in processes]
                    raise PreprocessError(f"a partition process died without reporting (exit codes {codes})") from None
        for process in processes:
            process.join()
        outcomes = [outcome[1:] for outcome in sorted(outcomes, key=lambda outcome: outcome[0])]  # partition order
        errors = [outcome[0] for outcome in outcomes if outcome[0] is not None]
        if errors:
            raise PreprocessError("; ".join(errors))
        if sum(outcome[1] for outcome in outcomes) == 0:
            raise PreprocessError(f"--input {args.input}: no usable document in any partition "
                                  "(empty input or every line was bad)")
        outputs = _Outputs(args.output_prefix, encoder.json_keys, level, encoder.dtype)
        try:
            for key, builder in outputs.builders.items():
                for prefix in partition_prefixes:
                    builder.add_index(_output_prefix(prefix, key, level))
            outputs.commit()
        except BaseException:
            outputs.abort()
            raise
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            if process.pid is not None:
                process.join()
        shutil.rmtree(scratch, ignore_errors=True)
    documents = sum(outcome[1] for outcome in outcomes)
    skipped = sum(outcome[2] for outcome in outcomes)
    examples = [entry for outcome in outcomes for entry in outcome[3]][:_SKIPPED_EXAMPLES]
    return documents, skipped, examples


# --------------------------------------------------------------------------------------------
# Benchmark mode


def find_optimal_num_workers(args, encoder: Encoder, level: str) -> int:
    """Time the first ``--max-documents`` lines with each of ``--workers-to-check``; print and return the fastest."""
    timings = []
    with tempfile.TemporaryDirectory() as scratch:
        sample = os.path.join(scratch, "sample.jsonl")
        with _open_lines(args.input) as source, open(sample, "wb") as sink:
            for count, line in enumerate(source):
                if count >= args.max_documents:
                    break
                sink.write(line)
        for workers in args.workers_to_check:
            start = time.time()
            process_file(sample, os.path.join(scratch, f"w{workers}"), encoder, workers, level,
                         log_interval=args.log_interval, skip_bad_lines=args.skip_bad_lines)
            elapsed = time.time() - start
            timings.append((elapsed, workers))
            print(f"workers={workers}: {elapsed:.3f} s", flush=True)
    best = min(timings)[1]
    print(f"Optimal number of workers: {best}", flush=True)
    return best


# --------------------------------------------------------------------------------------------
# Command line


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse Megatron's preprocess_data flags (plus ``--skip-bad-lines``); see the module docstring."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, required=True,
                       help="Path to input JSON lines (.jsonl or .jsonl.gz; a glob with --partitions > 1).")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="space separate listed of keys to extract from json")
    group.add_argument("--split-sentences", action="store_true", help="Split documents into sentences (needs nltk).")
    group.add_argument("--keep-newlines", action="store_true",
                       help="Keep newlines between sentences when splitting.")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="Skip (and count) malformed lines instead of stopping at the first one.")
    add_tokenizer_args(parser)
    group = parser.add_argument_group(title="tokenization process")
    group.add_argument("--append-eod", action="store_true", help="Append an <eod> token to the end of a document.")
    group.add_argument("--lang", type=str, default="english", help="Language to use for NLTK-powered sentence splitting.")
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True, help="Path to binary output file without suffix")
    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, required=True,
                       help="Number of worker processes to launch (1 encodes in the main process).")
    group.add_argument("--partitions", type=int, default=1, help="Number of file partitions")
    group.add_argument("--log-interval", type=int, default=1000, help="Interval between progress updates")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="Ensure ordering of samples in .jsonl files is preserved when using partitions>1.")
    group.add_argument("--find-optimal-num-workers", action="store_true",
                       help="Time --workers-to-check on the first --max-documents lines and report the fastest.")
    group.add_argument("--workers-to-check", nargs="+", type=int, default=[16, 32, 64],
                       help="Worker counts tried by --find-optimal-num-workers.")
    group.add_argument("--max-documents", type=int, default=100000,
                       help="Lines used by --find-optimal-num-workers.")
    args = parser.parse_args(argv)
    if args.tokenizer_type is None:
        parser.error("--tokenizer-type is required")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.partitions < 1:
        parser.error(f"--partitions must be >= 1, got {args.partitions}")
    if args.workers % args.partitions:
        parser.error(f"--workers ({args.workers}) must be divisible by --partitions ({args.partitions})")
    if len(set(args.json_keys)) != len(args.json_keys):
        parser.error(f"--json-keys lists a key twice: {' '.join(args.json_keys)}")
    if args.log_interval < 1:
        parser.error(f"--log-interval must be >= 1, got {args.log_interval}")
    if args.tokenizer_type.lower().startswith("bert") and not args.split_sentences:
        print("Are you sure you don't want to split sentences?", file=sys.stderr)
    # Fixed as in Megatron's tool: no TP padding beyond 128, and rank 1 silences build messages.
    args.rank = 1
    args.make_vocab_size_divisible_by = 128
    args.tensor_model_parallel_size = 1
    args.vocab_extra_ids = 0
    return args


def main(argv: Optional[List[str]] = None) -> int:
    """Run the tool; returns the process exit status (0 ok, 1 bad input or failure)."""
    args = get_args(argv)
    try:
        try:
            tokenizer = build_tokenizer(args)
        except (ValueError, FileNotFoundError) as error:
            raise PreprocessError(str(error)) from None
        if args.append_eod and tokenizer.eod is None:
            raise PreprocessError(f"--append-eod: {args.tokenizer_type} has no end-of-document id")
        if args.partitions == 1 and not os.path.isfile(args.input):
            raise PreprocessError(f"--input {args.input}: no such file")
        output_dir = os.path.dirname(os.path.abspath(args.output_prefix))
        if not os.path.isdir(output_dir):
            raise PreprocessError(f"--output-prefix {args.output_prefix}: folder {output_dir} does not exist")
        splitter_spec = (args.lang, args.keep_newlines) if args.split_sentences else None
        # Built here once so that a missing nltk or punkt data stops the run before any work.
        splitter = _build_sentence_splitter(*splitter_spec) if splitter_spec else None
        level = "sentence" if args.split_sentences else "document"
        encoder = Encoder(tokenizer, args.json_keys, args.append_eod,
                          DType.optimal_dtype(tokenizer.vocab_size), splitter, splitter_spec)
        if args.find_optimal_num_workers:
            find_optimal_num_workers(args, encoder, level)
            return 0
        start = time.time()
        if args.partitions == 1:
            _refuse_overwriting_inputs([args.input], args.output_prefix, args.json_keys, level)
            stats = process_file(args.input, args.output_prefix, encoder, args.workers, level,
                                 args.log_interval, args.skip_bad_lines)
            documents, skipped, examples = stats.documents, stats.skipped, stats.skipped_examples
        else:
            documents, skipped, examples = process_partitioned(args, encoder, level)
    except PreprocessError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    elapsed = time.time() - start
    print(f"Done: {documents} documents in {elapsed:.2f} s.", file=sys.stderr)
    if skipped:
        print(f"Skipped {skipped} bad line(s) (--skip-bad-lines):", file=sys.stderr)
        for entry in examples:
            print(f"  {entry}", file=sys.stderr)
        if skipped > len(examples):
            print(f"  ... and {skipped - len(examples)} more", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
