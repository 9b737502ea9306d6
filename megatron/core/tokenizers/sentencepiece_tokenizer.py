"""SentencePiece tokenizers: Megatron's SentencePieceTokenizer and GPTSentencePieceTokenizer."""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

import regex
import sentencepiece

from megatron.core.tokenizers.base import MegatronTokenizer


def _load_model(model_file: Optional[str]) -> sentencepiece.SentencePieceProcessor:
    if model_file is None:
        raise ValueError("SentencePiece tokenizers need --tokenizer-model (a .model file)")
    if not os.path.isfile(model_file):
        raise FileNotFoundError(f"--tokenizer-model: SentencePiece model not found: {model_file}")
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(model_file)
    except (OSError, RuntimeError) as error:
        raise ValueError(f"--tokenizer-model {model_file}: not a SentencePiece model ({error})") from None
    return processor


def _piece_or(processor: sentencepiece.SentencePieceProcessor, piece_id: int, fallback: str) -> str:
    # Models trained without a pad (or bos/eos) report id -1, which has no piece.
    if 0 <= piece_id < processor.GetPieceSize():
        return processor.IdToPiece(piece_id)
    return fallback


class SentencePieceTokenizer(MegatronTokenizer):
    """Megatron's ``SentencePieceTokenizer``: a SentencePiece model plus special tokens.

    After the model's own pieces come, in this order and only if the model lacks them,
    ``<CLS>``, ``<SEP>``, ``<EOD>``, ``<MASK>``, the model's pad piece (else ``<PAD>``), its bos
    piece (else ``<BOS>``), its eos piece (else ``<EOS>``) and ``<extra_id_0>`` ...
    ``<extra_id_{vocab_extra_ids-1}>``. ``eod`` is the ``<EOD>`` id (8002 for an 8,000-piece
    model), which is what Megatron's ``--append-eod`` writes. A special token's literal text
    inside the input is emitted as its id; the text between them goes through SentencePiece.

    Args:
        model_file: the ``.model`` file (``--tokenizer-model``).
        vocab_extra_ids: number of T5 sentinel tokens to add (``--vocab-extra-ids``).

    Raises:
        FileNotFoundError: the model file is missing (message names ``--tokenizer-model``).
        ValueError: the file is not a SentencePiece model.
    """

    def __init__(self, model_file: str, vocab_extra_ids: int = 0) -> None:
        self._processor = _load_model(model_file)
        super().__init__(model_file, vocab_extra_ids=vocab_extra_ids)
        self._model_file = model_file
        self._vocab_extra_ids = vocab_extra_ids
        size = self._processor.GetPieceSize()
        self._inv_vocab: Dict[int, str] = {i: self._processor.IdToPiece(i) for i in range(size)}
        self._vocab: Dict[str, int] = {piece: i for i, piece in self._inv_vocab.items()}
        self._special_tokens: Dict[str, int] = {}
        processor = self._processor
        self._cls_id = self._add_special_token("<CLS>")
        self._sep_id = self._add_special_token("<SEP>")
        self._eod_id = self._add_special_token("<EOD>")
        self._mask_id = self._add_special_token("<MASK>")
        self._pad_id = self._add_special_token(_piece_or(processor, processor.pad_id(), "<PAD>"))
        self._bos_id = self._add_special_token(_piece_or(processor, processor.bos_id(), "<BOS>"))
        self._eos_id = self._add_special_token(_piece_or(processor, processor.eos_id(), "<EOS>"))
        self._t5_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for token in self._t5_tokens:
            self._add_special_token(token)
        self._inv_special_tokens = {token_id: token for token, token_id in self._special_tokens.items()}
        # Alternation in insertion order: at the leftmost match position the earliest-added
        # token wins, the same choice as Megatron's scan for the minimum index.
        self._special_pattern = regex.compile("|".join(regex.escape(t) for t in self._special_tokens))

    def _add_special_token(self, token: str) -> int:
        if token not in self._vocab:
            new_id = len(self._vocab)
            self._vocab[token] = new_id
            self._inv_vocab[new_id] = token
        self._special_tokens[token] = self._vocab[token]
        return self._vocab[token]

    def __getstate__(self):
        return {"model_file": self._model_file, "vocab_extra_ids": self._vocab_extra_ids}

    def __setstate__(self, state):
        self.__init__(state["model_file"], state["vocab_extra_ids"])

    @property
    def vocab_size(self) -> int:
        """Model pieces plus the special tokens that were added (8,005 for an 8,000-piece model)."""
        return len(self._vocab)

    @property
    def vocab(self) -> Dict[str, int]:
        """Piece -> id, special tokens included."""
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        """Id -> piece, special tokens included."""
        return self._inv_vocab

    def tokenize(self, text: str) -> List[int]:
        """Text -> ids; literal special tokens (``<EOD>``, ``<s>`` ...) map to their ids."""
        ids: List[int] = []
        start = 0
        encode = self._processor.EncodeAsIds
        for match in self._special_pattern.finditer(text):
            ids.extend(encode(text[start:match.start()]))
            ids.append(self._special_tokens[match.group()])
            start = match.end()
        ids.extend(encode(text[start:]))
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        """Ids -> text; each special token is written as its text surrounded by spaces."""
        ids = [int(i) for i in ids]
        parts: List[str] = []
        start = 0
        for position, token_id in enumerate(ids):
            if token_id in self._inv_special_tokens:
                parts.append(self._processor.DecodeIds(ids[start:position]) + " ")
                parts.append(self._inv_special_tokens[token_id] + " ")
                start = position + 1
        parts.append(self._processor.DecodeIds(ids[start:]))
        return "".join(parts)

    @property
    def cls(self) -> int:
        """``<CLS>`` id."""
        return self._cls_id

    @property
    def sep(self) -> int:
        """``<SEP>`` id."""
        return self._sep_id

    @property
    def pad(self) -> int:
        """The model's pad piece id, or the added ``<PAD>`` id."""
        return self._pad_id

    @property
    def bos(self) -> int:
        """The model's bos piece id, or the added ``<BOS>`` id."""
        return self._bos_id

    @property
    def eod(self) -> int:
        """``<EOD>`` id: the id ``--append-eod`` appends."""
        return self._eod_id

    @property
    def eos(self) -> int:
        """The model's eos piece id, or the added ``<EOS>`` id."""
        return self._eos_id

    @property
    def mask(self) -> int:
        """``<MASK>`` id."""
        return self._mask_id

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        """Ids of the ``<extra_id_N>`` sentinels."""
        return [self._vocab[token] for token in self._t5_tokens]


class GPTSentencePieceTokenizer(MegatronTokenizer):
    """Megatron's ``GPTSentencePieceTokenizer``: the bare SentencePiece model, no added tokens.

    ``eod`` is the model's eos id; special-token text in the input is not treated specially.

    Args:
        model_file: the ``.model`` file (``--tokenizer-model``).

    Raises:
        FileNotFoundError: the model file is missing (message names ``--tokenizer-model``).
        ValueError: the file is not a SentencePiece model.
    """

    def __init__(self, model_file: str) -> None:
        self._processor = _load_model(model_file)
        super().__init__(model_file)
        self._model_file = model_file
        size = self._processor.GetPieceSize()
        self._inv_vocab = {i: self._processor.IdToPiece(i) for i in range(size)}
        self._vocab = {piece: i for i, piece in self._inv_vocab.items()}

    def __getstate__(self):
        return {"model_file": self._model_file}

    def __setstate__(self, state):
        self.__init__(state["model_file"])

    @property
    def vocab_size(self) -> int:
        """Number of pieces in the model."""
        return len(self._vocab)

    @property
    def vocab(self) -> Dict[str, int]:
        """Piece -> id."""
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        """Id -> piece."""
        return self._inv_vocab

    def tokenize(self, text: str) -> List[int]:
        """Text -> SentencePiece ids."""
        return self._processor.EncodeAsIds(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        """SentencePiece ids -> text."""
        return self._processor.DecodeIds([int(i) for i in ids])

    @property
    def eod(self) -> Optional[int]:
        """The model's eos id (``None`` if the model has none)."""
        return self.eos

    @property
    def eos(self) -> Optional[int]:
        """The model's eos id, or ``None``."""
        eos_id = self._processor.eos_id()
        return eos_id if eos_id >= 0 else None

    @property
    def bos(self) -> Optional[int]:
        """The model's bos id, or ``None``."""
        bos_id = self._processor.bos_id()
        return bos_id if bos_id >= 0 else None

    @property
    def pad(self) -> int:
        """The model's pad id (``-1`` if it has none)."""
        return self._processor.pad_id()
