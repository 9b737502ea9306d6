"""A tokenizer for text that already holds token ids as whitespace-separated integers."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from megatron.core.tokenizers.base import MegatronTokenizer


class NullTokenizer(MegatronTokenizer):
    """Megatron's ``NullTokenizer``: ``"3 1 4"`` -> ``[3, 1, 4]``.

    As in Megatron-LM, ``--vocab-size`` counts the ids *without* the end-of-document id, which is
    ``vocab_size`` itself: the vocabulary holds ``vocab_size + 1`` ids ``[0, vocab_size]``, and that
    is what the model's padded vocabulary and the ``.bin`` dtype (uint16 below 65,500 ids) follow.

    Args:
        vocab_size: ``--vocab-size``, number of ids before the end-of-document id.
        eod_id: end-of-document id (``--null-tokenizer-eod-id``); default ``vocab_size`` (Megatron's).
        pad_id: padding id (``--null-tokenizer-pad-id``); default ``-1`` (none).

    Raises:
        ValueError: ``vocab_size`` is missing or < 1, or ``eod_id`` is outside ``[0, vocab_size]``.
    """

    def __init__(self, vocab_size: int, eod_id: Optional[int] = None, pad_id: int = -1) -> None:
        if vocab_size is None or int(vocab_size) < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        vocab_size = int(vocab_size)
        eod_id = vocab_size if eod_id is None else int(eod_id)
        if not 0 <= eod_id <= vocab_size:
            raise ValueError(f"--null-tokenizer-eod-id {eod_id} is outside the vocabulary [0, {vocab_size}] "
                             f"(--vocab-size {vocab_size} plus the end-of-document id)")
        super().__init__(vocab_size=vocab_size, eod_id=eod_id, pad_id=pad_id)
        self._vocab_size_without_eod = vocab_size
        self._eod_id = eod_id
        self._pad_id = int(pad_id)
        self._vocab: Optional[Dict[str, int]] = None

    @property
    def vocab_size(self) -> int:
        """``--vocab-size + 1``: the ids ``[0, --vocab-size]``, end-of-document id included."""
        return self._vocab_size_without_eod + 1

    @property
    def vocab(self) -> Dict[str, int]:
        """Decimal spelling -> id (built on first use)."""
        if self._vocab is None:
            self._vocab = {str(i): i for i in range(self.vocab_size)}
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        """Id -> decimal spelling."""
        return {i: token for token, i in self.vocab.items()}

    def tokenize(self, text: str) -> List[int]:
        """Whitespace-separated integers -> ids; empty text gives ``[]``.

        Raises ValueError naming the field that is not an integer or not in ``[0, --vocab-size]``.
        """
        ids = []
        for field in text.split():
            try:
                token_id = int(field)
            except ValueError:
                raise ValueError(f"NullTokenizer: {field!r} is not an integer token id") from None
            if not 0 <= token_id <= self._vocab_size_without_eod:
                raise ValueError(f"NullTokenizer: id {token_id} is outside the vocabulary "
                                 f"[0, {self._vocab_size_without_eod}] (--vocab-size {self._vocab_size_without_eod} "
                                 "plus the end-of-document id)")
            ids.append(token_id)
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        """Ids -> space-separated decimal text."""
        return " ".join(str(int(i)) for i in ids)

    @property
    def eod(self) -> int:
        """``--null-tokenizer-eod-id`` (default ``--vocab-size``, as Megatron)."""
        return self._eod_id

    @property
    def pad(self) -> int:
        """``--null-tokenizer-pad-id`` (default ``-1``)."""
        return self._pad_id
