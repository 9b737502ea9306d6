"""A Hugging Face ``transformers`` tokenizer (Llama-3, Qwen, Mistral, ...) behind Megatron's tokenizer interface."""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

from megatron.core.tokenizers.base import MegatronTokenizer


class HuggingFaceTokenizer(MegatronTokenizer):
    """``transformers.AutoTokenizer.from_pretrained(DIR_OR_NAME)`` with Megatron's semantics.

    As Megatron's ``HuggingFaceTokenizer``: ``vocab_size`` is ``len(tokenizer)`` (added tokens
    included); ``eod`` is the id of the eos token (the sep token when there is no eos token);
    ``tokenize`` adds the tokenizer's own special tokens (e.g. a leading BOS) unless
    ``include_special_tokens`` is False (``--tokenizer-hf-no-include-special-tokens``).

    Args:
        pretrained_model_name_or_path: a local directory holding the tokenizer files, or a Hub
            name (downloaded by ``transformers`` if not in its cache).
        trust_remote_code: allow tokenizer code shipped with the model (``--trust-remote-code``).
        use_fast: load the Rust ("fast") tokenizer (off with ``--tokenizer-hf-no-use-fast``).
        include_special_tokens: see above.

    Raises:
        ImportError: transformers is not installed.
        ValueError: the tokenizer cannot be loaded (message names ``--tokenizer-model``).
    """

    def __init__(self, pretrained_model_name_or_path: str, trust_remote_code: bool = False, use_fast: bool = True,
                 include_special_tokens: bool = True) -> None:
        super().__init__(pretrained_model_name_or_path, trust_remote_code=trust_remote_code, use_fast=use_fast,
                         include_special_tokens=include_special_tokens)
        try:
            import transformers
        except ImportError:
            raise ImportError("--tokenizer-type HuggingFaceTokenizer needs the transformers package "
                              "(pip install 'megatron-otel[hf]' or pip install transformers)") from None
        self._options = dict(pretrained_model_name_or_path=pretrained_model_name_or_path,
                             trust_remote_code=trust_remote_code, use_fast=use_fast,
                             include_special_tokens=include_special_tokens)
        try:
            self._tokenizer = transformers.AutoTokenizer.from_pretrained(
                pretrained_model_name_or_path, trust_remote_code=trust_remote_code, use_fast=use_fast)
        except (OSError, ValueError, KeyError, TypeError) as error:
            where = "directory" if os.path.isdir(pretrained_model_name_or_path) else "name or path"
            raise ValueError(f"--tokenizer-model {pretrained_model_name_or_path}: cannot load a Hugging Face "
                             f"tokenizer from this {where} ({type(error).__name__}: {error})") from None
        self.include_special_tokens = include_special_tokens
        self._vocab: Optional[Dict[str, int]] = None
        self._inv_vocab: Optional[Dict[int, str]] = None

    def __getstate__(self):
        # Worker processes reload from the directory: small to send, and fast tokenizers do not
        # always survive pickling.
        return dict(self._options)

    def __setstate__(self, state):
        self.__init__(**state)

    @property
    def tokenizer(self):
        """The underlying ``transformers`` tokenizer."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """``len(tokenizer)``: the base vocabulary plus added tokens."""
        return len(self._tokenizer)

    @property
    def vocab(self) -> Dict[str, int]:
        """Token -> id, added tokens included."""
        if self._vocab is None:
            self._vocab = self._tokenizer.get_vocab()
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        """Id -> token."""
        if self._inv_vocab is None:
            self._inv_vocab = {token_id: token for token, token_id in self.vocab.items()}
        return self._inv_vocab

    def tokenize(self, text: str) -> List[int]:
        """Text -> ids as ``tokenizer(text, add_special_tokens=include_special_tokens).input_ids``."""
        # verbose=False: a long document is not an error here (no model-length limit applies).
        return self._tokenizer(text, add_special_tokens=self.include_special_tokens, verbose=False)["input_ids"]

    def detokenize(self, ids: Sequence[int]) -> str:
        """Ids -> text (special tokens kept, as ``tokenizer.decode``)."""
        return self._tokenizer.decode([int(token_id) for token_id in ids])

    def _special_id(self, name: str) -> Optional[int]:
        return getattr(self._tokenizer, f"{name}_token_id", None)

    @property
    def eod(self) -> Optional[int]:
        """Id of the eos token, else of the sep token, else None."""
        eos = self._special_id("eos")
        return eos if eos is not None else self._special_id("sep")

    @property
    def eos(self) -> Optional[int]:
        """Id of the eos token, or None."""
        return self._special_id("eos")

    @property
    def bos(self) -> Optional[int]:
        """Id of the bos token, or None."""
        return self._special_id("bos")

    @property
    def pad(self) -> int:
        """Id of the pad token, or -1."""
        pad = self._special_id("pad")
        return -1 if pad is None else pad

    @property
    def cls(self) -> Optional[int]:
        """Id of the cls token, or None."""
        return self._special_id("cls")

    @property
    def sep(self) -> Optional[int]:
        """Id of the sep token, or None."""
        return self._special_id("sep")

    @property
    def mask(self) -> Optional[int]:
        """Id of the mask token, or None."""
        return self._special_id("mask")
