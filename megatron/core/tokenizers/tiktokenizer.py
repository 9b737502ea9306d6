"""Megatron's TikTokenizer: a tiktoken BPE vocabulary file with reserved special-token ids in front."""
from __future__ import annotations

import base64
import json
import os
from typing import Dict, List, Optional, Sequence

from megatron.core.tokenizers.base import MegatronTokenizer

# Megatron's --tiktoken-pattern choices (its training/tokenizer code): v1 keeps letter runs whole,
# v2 splits camel case and keeps "/" and newlines after punctuation.
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
          r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# Megatron requires these three among the special tokens; </s> is the end of document.
REQUIRED_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
# Megatron's vocabulary size when --vocab-size is not given.
DEFAULT_VOCAB_SIZE = 2 ** 17


def load_tiktoken_ranks(path: str, max_vocab: Optional[int] = None) -> Dict[bytes, int]:
    """Token bytes -> rank from a vocabulary file, keeping the first ``max_vocab`` entries.

    Two formats: Megatron's/NeMo's JSON list of ``{"rank": i, "token_bytes": base64, "token_str": s}``
    with rank == position and entries 0..255 the single bytes 0..255 (``.json``), or tiktoken's
    own text format, one ``base64 rank`` per line (``.tiktoken``, Llama-3's ``tokenizer.model``).

    Raises FileNotFoundError or ValueError naming ``--tokenizer-model`` when the file is missing or malformed.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--tokenizer-model: tiktoken vocabulary file not found: {path}")
    ranks: Dict[bytes, int] = {}
    try:
        if path.endswith(".json"):
            with open(path, encoding="utf-8") as stream:
                entries = json.load(stream)
            if not isinstance(entries, list):
                raise ValueError("expected a JSON list of {rank, token_bytes, token_str} objects")
            for index, entry in enumerate(entries[:max_vocab] if max_vocab is not None else entries):
                if not isinstance(entry, dict) or entry.get("rank") != index or "token_bytes" not in entry:
                    raise ValueError(f"entry {index} is not {{\"rank\": {index}, \"token_bytes\": ...}}")
                token = base64.b64decode(entry["token_bytes"])
                if index < 256 and token != bytes([index]):
                    raise ValueError(f"entry {index} must be the single byte {index}")
                ranks[token] = index
        else:
            with open(path, "rb") as stream:
                for line_number, line in enumerate(stream, start=1):
                    if not line.strip():
                        continue
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
                    if max_vocab is not None and len(ranks) >= max_vocab:
                        break
    except (ValueError, json.JSONDecodeError, UnicodeDecodeError, base64.binascii.Error) as error:
        raise ValueError(f"--tokenizer-model {path}: not a tiktoken vocabulary ({error})") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"--tokenizer-model {path}: ranks are not 0..{len(ranks) - 1} without repeats")
    return ranks


class TikTokenizer(MegatronTokenizer):
    """Byte-level BPE run by ``tiktoken`` with Megatron's id layout.

    Ids ``0 .. num_special_tokens-1`` are special tokens (``special_tokens`` first, then fillers
    ``<SPECIAL_i>``); the file's token of rank r gets id ``r + num_special_tokens``; only the first
    ``vocab_size - num_special_tokens`` ranks of the file are used. ``tokenize`` never produces
    special ids (special-token text is encoded as ordinary text); ``eod`` = ``eos`` = id of ``</s>``.

    Args:
        path: vocabulary file (``--tokenizer-model``), see ``load_tiktoken_ranks``.
        pattern: ``"v1"``, ``"v2"`` (``--tiktoken-pattern``) or a regex string.
        vocab_size: total ids (``--vocab-size``), default 2**17 as Megatron.
        num_special_tokens: reserved ids (``--tiktoken-num-special-tokens``, default 1000).
        special_tokens: names of the first special ids (``--tokenizer-special-tokens``); must
            include ``<unk>``, ``<s>``, ``</s>``; default exactly those three.

    Raises:
        ImportError: tiktoken is not installed.
        ValueError: a bad pattern, special tokens, sizes, or a file shorter than the vocabulary.
        FileNotFoundError: the file is missing.
    """

    def __init__(self, path: str, pattern: str = "v2", vocab_size: Optional[int] = None,
                 num_special_tokens: int = 1000, special_tokens: Optional[List[str]] = None) -> None:
        try:
            import tiktoken
        except ImportError:
            raise ImportError("--tokenizer-type TikTokenizer needs the tiktoken package (pip install tiktoken)") from None
        if pattern is None:
            raise ValueError("--tokenizer-type TikTokenizer needs --tiktoken-pattern (v1 or v2)")
        pattern_string = TIKTOKEN_PATTERNS.get(pattern, pattern)
        vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else int(vocab_size)
        super().__init__(path, pattern=pattern_string, vocab_size=vocab_size, num_special_tokens=num_special_tokens,
                         special_tokens=special_tokens)
        self._options = dict(path=path, pattern=pattern, vocab_size=vocab_size,
                             num_special_tokens=num_special_tokens, special_tokens=special_tokens)
        special_tokens = list(REQUIRED_SPECIAL_TOKENS if special_tokens is None else special_tokens)
        if len(set(special_tokens)) != len(special_tokens):
            raise ValueError(f"--tokenizer-special-tokens lists a token twice: {special_tokens}")
        missing = [token for token in REQUIRED_SPECIAL_TOKENS if token not in special_tokens]
        if missing:
            raise ValueError(f"--tokenizer-special-tokens must include {REQUIRED_SPECIAL_TOKENS} (missing {missing})")
        if not len(special_tokens) <= num_special_tokens < vocab_size:
            raise ValueError(f"--tiktoken-num-special-tokens ({num_special_tokens}) must be at least the number of "
                             f"special tokens ({len(special_tokens)}) and below --vocab-size ({vocab_size})")
        special_tokens += [f"<SPECIAL_{i}>" for i in range(len(special_tokens), num_special_tokens)]
        inner_size = vocab_size - num_special_tokens
        ranks = load_tiktoken_ranks(path, max_vocab=inner_size)
        if len(ranks) < inner_size:
            raise ValueError(f"--tokenizer-model {path} holds {len(ranks)} tokens, fewer than --vocab-size "
                             f"({vocab_size}) - --tiktoken-num-special-tokens ({num_special_tokens}) = {inner_size}")
        shifted = {token: rank + num_special_tokens for token, rank in ranks.items()}
        self._special = {token: index for index, token in enumerate(special_tokens)}
        self._vocab_size = vocab_size
        self._model = tiktoken.Encoding(name=os.path.basename(path), pat_str=pattern_string,
                                        mergeable_ranks=shifted, special_tokens=self._special)
        self._id_to_token: Dict[int, object] = {token_id: token for token, token_id in shifted.items()}
        self._id_to_token.update({token_id: token for token, token_id in self._special.items()})
        self._token_to_id: Dict[object, int] = {token: token_id for token_id, token in self._id_to_token.items()}

    def __getstate__(self):
        return dict(self._options)

    def __setstate__(self, state):
        self.__init__(**state)

    @property
    def vocab_size(self) -> int:
        """Special ids plus the file's ids in use (``--vocab-size``)."""
        return self._vocab_size

    @property
    def vocab(self) -> Dict[object, int]:
        """Token (bytes for BPE tokens, str for special tokens) -> id."""
        return self._token_to_id

    @property
    def inv_vocab(self) -> Dict[int, object]:
        """Id -> token (bytes or str)."""
        return self._id_to_token

    def tokenize(self, text: str) -> List[int]:
        """Text -> ids with ``encode_ordinary`` (special-token text is not turned into special ids)."""
        return self._model.encode_ordinary(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Ids -> text; bytes that are not valid UTF-8 decode to U+FFFD."""
        return self._model.decode([int(token_id) for token_id in ids])

    @property
    def bos(self) -> int:
        """Id of ``<s>``."""
        return self._special["<s>"]

    @property
    def eos(self) -> int:
        """Id of ``</s>``."""
        return self._special["</s>"]

    @property
    def eod(self) -> int:
        """Id of ``</s>`` (Megatron's end of document for this tokenizer)."""
        return self._special["</s>"]

    @property
    def unk(self) -> int:
        """Id of ``<unk>``."""
        return self._special["<unk>"]
