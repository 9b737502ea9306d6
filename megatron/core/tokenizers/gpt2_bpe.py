"""GPT-2's byte-level BPE tokenizer, producing the same ids as OpenAI's release and Megatron-LM."""
from __future__ import annotations

import json
import os
import re
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import numpy
import regex

from megatron.core.tokenizers.base import MegatronTokenizer

# Pre-tokenization of GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask
# Learners", §2.2): contractions, letter runs, digit runs and other-symbol runs each keep one
# leading space; a whitespace run gives its last space to the following word.
GPT2_PRETOKENIZE_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# The same split without the look-ahead, which tiktoken's regex engine runs about twice as fast.
# The two differ only on a run of >= 2 whitespace characters followed by a non-space: the
# look-ahead gives all but the run's last character as one piece and starts the next piece at
# that last character. Cutting the text there first (``_WHITESPACE_CUT``) and splitting each part
# without the look-ahead gives the same pieces: every cut is a piece boundary of the original split.
# The contractions come after the letter and digit runs here (another 5-10% faster in tiktoken):
# the first alternative that matches wins, and a contraction starts with ' where a letter or digit
# run (with its optional space) cannot, so no position has a different winner.
_PRETOKENIZE_PATTERN_NO_LOOKAHEAD = r""" ?\p{L}+| ?\p{N}+|'s|'t|'re|'ve|'m|'ll|'d| ?[^\s\p{L}\p{N}]+|\s+"""
# Cut before the last character of such a run (``\s`` is Unicode White_Space here and in tiktoken).
_WHITESPACE_CUT = regex.compile(r"\s{2,}(?=\S)")

END_OF_TEXT = "<|endoftext|>"

# ``tokenize_many`` joins its texts, each followed by this marker, into one tiktoken call: it is a
# special token (id just past the vocabulary), so pre-tokenization never merges across it, and no
# proper prefix of it is also a suffix, so its matches cannot overlap: if the ids hold exactly one
# marker per text, no text spelled it.
_TEXT_END = "<|megatron-tokenize-many-text-end|>"
# The characters outside ASCII that are White_Space (``\s`` in tiktoken's and in ``regex``'s patterns).
_NON_ASCII_WHITESPACE = re.compile("[\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]")
_ASCII_WHITESPACE = frozenset(b" \t\n\r\x0b\x0c")
# Token classes for finding, in tiktoken's output, where ``_WHITESPACE_CUT`` would have cut.
_SPECIAL, _TEXT, _ONE_WHITESPACE, _LONG_WHITESPACE = 0, 1, 2, 3

# Which implementation GPT2BPETokenizer uses when its ``backend`` argument is not given: "auto"
# (tiktoken when installed and the files allow it, else pure Python), "tiktoken" or "python".
BACKEND_ENV = "MEGATRON_GPT2_BPE_BACKEND"
_BACKENDS = ("auto", "tiktoken", "python")

# Bound on the per-pre-token cache so memory stays flat on huge corpora (it is cleared, not
# evicted piecemeal: a full refill costs far less than LRU bookkeeping on every lookup).
_CACHE_LIMIT = 1 << 19


def bytes_to_unicode() -> Dict[int, str]:
    """Byte value (0..255) -> the printable unicode character GPT-2 uses to spell it in its vocab.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map, in increasing byte
    order, to code points 256, 257, ... (the table of GPT-2's ``encoder.py``).
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    table = {byte: chr(byte) for byte in printable}
    shifted = 256
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(shifted)
            shifted += 1
    return table


def _require_file(path: Optional[str], flag: str, what: str) -> str:
    if path is None:
        raise ValueError(f"GPT2BPETokenizer needs {flag} (the GPT-2 {what})")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag}: GPT-2 {what} not found: {path}")
    return path


def _load_vocab(vocab_file: str) -> Dict[str, int]:
    try:
        with open(vocab_file, encoding="utf-8") as stream:
            vocab = json.load(stream)
    except json.JSONDecodeError as error:
        raise ValueError(f"--vocab-file {vocab_file}: not valid JSON ({error})") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise ValueError(f"--vocab-file {vocab_file}: expected a JSON object mapping token -> integer id")
    return vocab


def _load_merges(merge_file: str) -> Dict[Tuple[str, str], int]:
    ranks: Dict[Tuple[str, str], int] = {}
    with open(merge_file, encoding="utf-8") as stream:
        for line_number, line in enumerate(stream, start=1):
            line = line.rstrip("\r\n")
            if not line or (line_number == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError(f"--merge-file {merge_file}:{line_number}: expected two symbols, got {line!r}")
            ranks.setdefault((parts[0], parts[1]), len(ranks))
    return ranks


def _build_tiktoken_encoding(encoder: Dict[str, int], bpe_ranks: Dict[Tuple[str, str], int],
                             byte_decoder: Dict[str, int], name: str):
    """A ``tiktoken.Encoding`` giving the same ids as ``GPT2BPETokenizer.bpe``, or a reason it cannot.

    tiktoken ranks a candidate merge by the id of the token it would produce, while GPT-2 ranks
    merge *pairs* by their line in the merge file. The two agree when every merge yields a new
    token whose id grows with its merge line and every non-byte token is made by some merge
    (true of GPT-2's release and of files written by the usual BPE trainers); vocabulary entries
    that no merge produces (``<|endoftext|>``) become tiktoken special tokens. The encoding splits
    with ``_PRETOKENIZE_PATTERN_NO_LOOKAHEAD``: run it through ``_tiktoken_encode``. Returns
    ``(encoding, None)`` or ``(None, reason)``; raises ImportError when tiktoken is not installed.
    """
    import tiktoken

    def to_bytes(symbol: str) -> bytes:
        return bytes(byte_decoder[char] for char in symbol)

    mergeable: Dict[bytes, int] = {}
    for char, byte in byte_decoder.items():
        token_id = encoder.get(char)
        if token_id is None:
            return None, f"byte {byte} has no vocabulary entry"
        mergeable[bytes([byte])] = token_id
    previous = -1
    for (first, second), _ in sorted(bpe_ranks.items(), key=lambda item: item[1]):
        merged = first + second
        token_id = encoder.get(merged)
        if token_id is None:
            return None, f"merge {first!r} {second!r} makes {merged!r}, which the vocabulary lacks"
        try:
            merged_bytes = to_bytes(merged)
        except KeyError:
            return None, f"merge result {merged!r} is not spelled in GPT-2's byte alphabet"
        if merged_bytes in mergeable:
            return None, f"{merged!r} is made by two merges"
        if token_id <= previous:
            return None, "token ids do not grow with the merge order"
        previous = token_id
        mergeable[merged_bytes] = token_id
    ranked_ids = set(mergeable.values())
    special = {token: token_id for token, token_id in encoder.items() if token_id not in ranked_ids}
    if any(not (token.startswith("<|") and token.endswith("|>")) for token in special):
        return None, "the vocabulary holds tokens that no merge produces"
    special[_TEXT_END] = max(encoder.values()) + 1
    encoding = tiktoken.Encoding(name=name, pat_str=_PRETOKENIZE_PATTERN_NO_LOOKAHEAD, mergeable_ranks=mergeable,
                                 special_tokens=special)
    return encoding, None


def _token_classes(encoder: Dict[str, int], byte_encoder: Dict[int, str], special_ids: Sequence[int],
                   size: int) -> numpy.ndarray:
    """[size] uint8 per id: ``_ONE_WHITESPACE`` / ``_LONG_WHITESPACE`` for a token of one / several
    ASCII whitespace bytes only, ``_SPECIAL`` for ``special_ids`` (``<|endoftext|>``, the
    ``_TEXT_END`` marker), ``_TEXT`` for every other token."""
    classes = numpy.full(size, _TEXT, dtype=numpy.uint8)
    whitespace_spelling = {byte_encoder[byte] for byte in _ASCII_WHITESPACE}
    for token, token_id in encoder.items():
        if whitespace_spelling.issuperset(token):  # one character per byte in GPT-2's spelling
            classes[token_id] = _ONE_WHITESPACE if len(token) == 1 else _LONG_WHITESPACE
    classes[list(special_ids)] = _SPECIAL
    return classes


def _tiktoken_encode(encoding, text: str) -> List[int]:
    """GPT-2 ids of ``text`` (no special tokens) with an encoding from ``_build_tiktoken_encoding``."""
    encode = encoding.encode_ordinary
    start = 0
    ids: List[int] = []
    for run in _WHITESPACE_CUT.finditer(text):
        cut = run.end() - 1
        ids.extend(encode(text[start:cut]))
        start = cut
    if start == 0:
        return encode(text)
    ids.extend(encode(text[start:]))
    return ids


class GPT2BPETokenizer(MegatronTokenizer):
    """Byte-level BPE (Sennrich et al. 2016, "Neural Machine Translation of Rare Words with
    Subword Units", §3.1) over UTF-8 bytes as in GPT-2 (Radford et al. 2019, §2.2).

    Text is split by GPT-2's pre-tokenization regex; each piece's UTF-8 bytes are spelled with
    ``bytes_to_unicode`` and merged greedily, lowest merge rank first. A literal
    ``<|endoftext|>`` in the text becomes the end-of-text id, as with the HuggingFace GPT-2
    tokenizer that backs Megatron's.

    Two implementations give the same ids: ``tiktoken`` built from the same two files (Rust,
    many times faster; used for ``tokenize`` when installed) and the pure-Python reference
    (``bpe``; always available, used by the tests as the reference).

    Args:
        vocab_file: ``gpt2-vocab.json`` (token -> id).
        merge_file: ``gpt2-merges.txt`` (``#version`` header, then one merge per line, by rank).
        backend: ``"auto"`` (tiktoken when installed and the files allow it, see
            ``_build_tiktoken_encoding``; else Python), ``"tiktoken"`` (required) or ``"python"``;
            default: the ``MEGATRON_GPT2_BPE_BACKEND`` environment variable, else ``"auto"``.
            ``self.backend`` says which one is in use.

    Raises:
        FileNotFoundError: a file is missing (message names ``--vocab-file``/``--merge-file``).
        ValueError: a file is malformed, the vocab has no ``<|endoftext|>``, ``backend`` is
            unknown, or ``"tiktoken"`` was asked for and the files do not allow it.
        ImportError: ``"tiktoken"`` was asked for and tiktoken is not installed.
    """

    def __init__(self, vocab_file: str, merge_file: str, backend: Optional[str] = None) -> None:
        _require_file(vocab_file, "--vocab-file", "vocabulary (gpt2-vocab.json)")
        _require_file(merge_file, "--merge-file", "merges (gpt2-merges.txt)")
        super().__init__(vocab_file, merge_file)
        self._vocab_file = vocab_file
        self._merge_file = merge_file
        self._encoder = _load_vocab(vocab_file)
        self._decoder = {token_id: token for token, token_id in self._encoder.items()}
        self._bpe_ranks = _load_merges(merge_file)
        if END_OF_TEXT not in self._encoder:
            raise ValueError(f"--vocab-file {vocab_file}: has no {END_OF_TEXT} token")
        self._eod_id = self._encoder[END_OF_TEXT]
        byte_encoder = bytes_to_unicode()
        # Keyed by byte value, so str.translate over a latin-1 view of a piece's UTF-8 bytes spells
        # the whole piece in one C call.
        self._byte_spelling = byte_encoder
        self._byte_decoder = {char: byte for byte, char in byte_encoder.items()}
        self._pattern = regex.compile(GPT2_PRETOKENIZE_PATTERN)
        self._cache: Dict[str, List[int]] = {}
        self._requested_backend = backend
        self._tiktoken = None
        self.backend = self._select_backend(backend)

    def _select_backend(self, backend: Optional[str]) -> str:
        if backend is None:
            backend = os.environ.get(BACKEND_ENV, "auto") or "auto"
        if backend not in _BACKENDS:
            raise ValueError(f"GPT2BPETokenizer backend must be one of {', '.join(_BACKENDS)}, got {backend!r} "
                             f"(argument or {BACKEND_ENV})")
        if backend == "python":
            return "python"
        try:
            encoding, reason = _build_tiktoken_encoding(self._encoder, self._bpe_ranks, self._byte_decoder,
                                                        name=os.path.basename(self._vocab_file))
        except ImportError:
            if backend == "tiktoken":
                raise ImportError("GPT2BPETokenizer backend 'tiktoken' needs the tiktoken package "
                                  "(pip install tiktoken)") from None
            return "python"
        if encoding is None:
            message = (f"--vocab-file {self._vocab_file} / --merge-file {self._merge_file} cannot be run by "
                       f"tiktoken: {reason}")
            if backend == "tiktoken":
                raise ValueError(message)
            warnings.warn(message + "; using the pure-Python BPE (same ids, slower)")
            return "python"
        self._tiktoken = encoding
        self._text_end_id = encoding.encode_single_token(_TEXT_END)
        special_ids = [encoding.encode_single_token(token) for token in encoding.special_tokens_set]
        self._token_classes = _token_classes(self._encoder, self._byte_spelling, special_ids, encoding.n_vocab)
        return "tiktoken"

    def __getstate__(self):
        # Worker processes rebuild from the files rather than receive megabytes of dicts.
        return {"vocab_file": self._vocab_file, "merge_file": self._merge_file, "backend": self._requested_backend}

    def __setstate__(self, state):
        self.__init__(state["vocab_file"], state["merge_file"], state.get("backend"))

    @property
    def vocab_size(self) -> int:
        """Number of ids in the vocabulary file (50,257 for GPT-2)."""
        return len(self._encoder)

    @property
    def vocab(self) -> Dict[str, int]:
        """Byte-spelled token -> id."""
        return self._encoder

    @property
    def inv_vocab(self) -> Dict[int, str]:
        """Id -> byte-spelled token."""
        return self._decoder

    @property
    def eod(self) -> int:
        """Id of ``<|endoftext|>`` (50256 for GPT-2)."""
        return self._eod_id

    @property
    def eos(self) -> int:
        """GPT-2 ends sequences with ``<|endoftext|>`` too."""
        return self._eod_id

    @property
    def bos(self) -> int:
        """GPT-2 starts sequences with ``<|endoftext|>`` too."""
        return self._eod_id

    def bpe(self, piece: str) -> List[str]:
        """Merge the byte-spelled ``piece`` into vocabulary symbols, lowest-ranked pair first.

        Every occurrence of the chosen pair is merged left to right without overlap before the
        next pair is chosen, as in the reference implementation.
        """
        symbols = list(piece)
        ranks = self._bpe_ranks
        while len(symbols) > 1:
            best_rank = None
            best_pair = None
            for pair in zip(symbols, symbols[1:]):
                rank = ranks.get(pair)
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank = rank
                    best_pair = pair
            if best_pair is None:
                break
            first, second = best_pair
            merged = first + second
            out = []
            i = 0
            last = len(symbols) - 1
            while i <= last:
                if i < last and symbols[i] == first and symbols[i + 1] == second:
                    out.append(merged)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            symbols = out
        return symbols

    def _encode_piece(self, piece: str) -> List[int]:
        spelled = piece.encode("utf-8").decode("latin-1").translate(self._byte_spelling)
        try:
            ids = [self._encoder[symbol] for symbol in self.bpe(spelled)]
        except KeyError as error:
            raise ValueError(
                f"--merge-file {self._merge_file} produced symbol {error.args[0]!r}, "
                f"which --vocab-file {self._vocab_file} does not contain"
            ) from None
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[piece] = ids
        return ids

    def _encode_plain(self, text: str) -> List[int]:
        cache = self._cache
        ids: List[int] = []
        extend = ids.extend
        for piece in self._pattern.findall(text):
            cached = cache.get(piece)
            extend(cached if cached is not None else self._encode_piece(piece))
        return ids

    def _encode_plain_tiktoken(self, text: str) -> List[int]:
        return _tiktoken_encode(self._tiktoken, text)

    def tokenize(self, text: str) -> List[int]:
        """Text -> GPT-2 ids, e.g. ``"Hello world, it's me"`` -> ``[15496, 995, 11, 340, 338, 502]``.

        Raises UnicodeEncodeError if ``text`` holds a lone surrogate (it has no UTF-8 bytes).
        """
        if self._tiktoken is not None:
            # tiktoken would silently replace a lone surrogate; the reference refuses it.
            text.encode("utf-8")
            encode_plain = self._encode_plain_tiktoken
        else:
            encode_plain = self._encode_plain
        if END_OF_TEXT not in text:
            return encode_plain(text)
        ids: List[int] = []
        chunks = text.split(END_OF_TEXT)
        for index, chunk in enumerate(chunks):
            if index:
                ids.append(self._eod_id)
            if chunk:
                ids.extend(encode_plain(chunk))
        return ids

    def tokenize_many(self, texts: Sequence[str]) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """``(ids [sum(counts)] uint32, counts [len(texts)] int64)``: the ids of ``tokenize`` on each text, back to back.

        On tiktoken the texts are joined, each followed by the ``_TEXT_END`` special token, and encoded
        in one call, which saves the per-call cost of thousands of short documents. That call splits
        without ``_WHITESPACE_CUT``: a text where a cut would fall (a run of >= 2 whitespace characters
        before a non-space, found in the ids: whitespace-only tokens spanning >= 2 bytes followed by
        a text token) or holding non-ASCII whitespace (where the ids cannot tell) is encoded again on
        its own with ``tokenize``. Raises UnicodeEncodeError for a lone surrogate, as ``tokenize``.
        """
        if self._tiktoken is None or not texts:
            return super().tokenize_many(texts)
        joined = _TEXT_END.join(texts) + _TEXT_END
        joined.encode("utf-8")  # tiktoken would silently replace a lone surrogate; the reference refuses it
        ids = self._tiktoken.encode_to_numpy(joined, allowed_special="all")
        ends = numpy.flatnonzero(ids == self._text_end_id)
        if len(ends) != len(texts):  # some text spells the marker itself
            return super().tokenize_many(texts)
        counts = numpy.diff(ends, prepend=-1) - 1
        classes = self._token_classes[ids]
        whitespace = classes >= _ONE_WHITESPACE
        after_whitespace = numpy.zeros_like(whitespace)
        after_whitespace[1:] = whitespace[:-1]
        # Whitespace runs spanning >= 2 bytes (here: characters), at their last token.
        long_run = whitespace & ((classes == _LONG_WHITESPACE) | after_whitespace)
        cut_at = numpy.flatnonzero(long_run[:-1] & (classes[1:] == _TEXT))
        redo = set(numpy.searchsorted(ends, cut_at).tolist())
        if not joined.isascii() and _NON_ASCII_WHITESPACE.search(joined):
            redo.update(index for index, text in enumerate(texts) if _NON_ASCII_WHITESPACE.search(text))
        ids = numpy.delete(ids, ends)
        if redo:
            starts = numpy.cumsum(counts) - counts
            pieces, done = [], 0
            for index in sorted(redo):
                exact = numpy.asarray(self.tokenize(texts[index]), dtype=ids.dtype)
                pieces += [ids[done:starts[index]], exact]
                done = starts[index] + counts[index]
                counts[index] = exact.size
            pieces.append(ids[done:])
            ids = numpy.concatenate(pieces)
        return ids, counts

    def detokenize(self, ids: Sequence[int]) -> str:
        """GPT-2 ids -> text; byte sequences that are not valid UTF-8 decode to U+FFFD."""
        spelled = "".join(self._decoder[int(token_id)] for token_id in ids)
        return bytes(self._byte_decoder[char] for char in spelled).decode("utf-8", errors="replace")
