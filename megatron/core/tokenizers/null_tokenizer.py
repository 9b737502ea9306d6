"""A tokenizer for text that already holds token ids as whitespace-separated integers."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from megatron.core.tokenizers.base import MegatronTokenizer


class NullTokenizer(MegatronTokenizer):
    """Megatron's ``NullTokenizer``: ``"3 1 4"`` -> ``[3, 1, 4]``.

    Args:
        vocab_size: number of ids (``--vocab-size``); ids must lie in ``[0, vocab_size)``.
        eod_id: end-of-document id (``--null-tokenizer-eod-id``); default ``vocab_size - 1``.
        pad_id: padding id (``--null-tokenizer-pad-id``); default ``-1`` (none).

    Raises:
        ValueError: ``vocab_size`` is missing or < 1, or ``eod_id`` is outside the vocabulary.
    """

    def __init__(self, vocab_size: int, eod_id: Optional[int] = None, pad_id: int = -1) -> None:
        if vocab_size is None or int(vocab_size) < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        vocab_size = int(vocab_size)
        eod_id = vocab_size - 1 if eod_id is None else int(eod_id)
        if not 0 <= eod_id < vocab_size:
            raise ValueError(f"--null-tokenizer-eod-id {eod_id} is outside the vocabulary [0, {vocab_size})")
        super().__init__(vocab_size=vocab_size, eod_id=eod_id, pad_id=pad_id)
        self._vocab_size = vocab_size
        self._eod_id = eod_id
        self._pad_id = int(pad_id)
        self._vocab: Optional[Dict[str, int]] = None

    @property
    def vocab_size(self) -> int:
        """``--vocab-size``."""
        return self._vocab_size

    @property
    def vocab(self) -> Dict[str, int]:
        """Decimal spelling -> id (built on first use)."""
        if self._vocab is None:
            self._vocab = {str(i): i for i in range(self._vocab_size)}
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        """Id -> decimal spelling."""
        return {i: token for token, i in self.vocab.items()}

    def tokenize(self, text: str) -> List[int]:
        """Whitespace-separated integers -> ids; empty text gives ``[]``.

        Raises ValueError naming the field that is not an integer or not in ``[0, vocab_size)``.
        """
        ids = []
        for field in text.split():
            try:
                token_id = int(field)
            except ValueError:
                raise ValueError(f"NullTokenizer: {field!r} is not an integer token id") from None
            if not 0 <= token_id < self._vocab_size:
                raise ValueError(f"NullTokenizer: id {token_id} is outside the vocabulary [0, {self._vocab_size})")
            ids.append(token_id)
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        """Ids -> space-separated decimal text."""
        return " ".join(str(int(i)) for i in ids)

    @property
    def eod(self) -> int:
        """``--null-tokenizer-eod-id`` (default ``vocab_size - 1``)."""
        return self._eod_id

    @property
    def pad(self) -> int:
        """``--null-tokenizer-pad-id`` (default ``-1``)."""
        return self._pad_id
