"""Megatron's tokenizer command-line flags and the factory that builds a tokenizer from them."""
from __future__ import annotations

import argparse
import math

from megatron.core.console import write_line
from megatron.core.tokenizers import (
    GPT2BPETokenizer,
    GPTSentencePieceTokenizer,
    HuggingFaceTokenizer,
    MegatronTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    TikTokenizer,
)

# Every type Megatron's parser accepts, so its command lines parse unchanged here.
TOKENIZER_TYPES = [
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "MultimodalTokenizer",
    "NullTokenizer",
    "NullMultimodalTokenizer",
    "SFTTokenizer",
]

SUPPORTED_TOKENIZER_TYPES = ["GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                             "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer"]


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add Megatron's "tokenizer" argument group (same flags and defaults) to ``parser``; returns it."""
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--vocab-size", type=int, default=None, help="Size of vocab before EOD or padding.")
    group.add_argument("--padded-vocab-size", type=int, default=None,
                       help="Vocabulary size of the model (padded to be divisible by tensor model parallel size). "
                            "If not provided, it is computed from the tokenizer.")
    group.add_argument("--vocab-file", type=str, default=None, help="Path to the vocab file.")
    group.add_argument("--merge-file", type=str, default=None, help="Path to the BPE merge file.")
    group.add_argument("--vocab-extra-ids", type=int, default=0,
                       help="Number of additional vocabulary tokens. They are used for span masking in the T5 model.")
    group.add_argument("--tokenizer-type", type=str, default=None, choices=TOKENIZER_TYPES,
                       help=f"What type of tokenizer to use (supported here: {', '.join(SUPPORTED_TOKENIZER_TYPES)}).")
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="Sentencepiece tokenizer model, Hugging Face tokenizer directory or name "
                            "(HuggingFaceTokenizer), or tiktoken vocabulary file (TikTokenizer).")
    group.add_argument("--tokenizer-special-tokens", type=str, nargs="+", default=None,
                       help="List of special tokens (HuggingFace/TikToken tokenizers).")
    group.add_argument("--tiktoken-pattern", type=str, default=None,
                       help="Which tiktoken pattern to use. Options: [v1, v2].")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                       help="Number of special tokens in tiktoken tokenizer.")
    group.add_argument("--tiktoken-special-tokens", type=str, nargs="+", default=None,
                       help="Deprecated alias of --tokenizer-special-tokens (TikTokenizer; must include "
                            "<unk>, <s>, </s>).")
    group.add_argument("--null-tokenizer-eod-id", type=int, default=None,
                       help="End-of-document id of NullTokenizer (default: --vocab-size, as Megatron; the vocabulary is "
                            "--vocab-size + 1 ids).")
    group.add_argument("--null-tokenizer-pad-id", type=int, default=-1, help="Padding id of NullTokenizer.")
    group.add_argument("--trust-remote-code", action="store_true", default=False,
                       help="Whether or not to allow HuggingFace tokenizers defined on the Hub in their own modeling files.")
    group.add_argument("--tokenizer-hf-no-use-fast", action="store_false", dest="tokenizer_hf_use_fast",
                       help="Do not use the fast HuggingFace tokenizer.")
    group.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_false",
                       dest="tokenizer_hf_include_special_tokens",
                       help="Do not convert special tokens to ids when tokenizing with HuggingFace tokenizers.")
    return parser


def _vocab_size_with_padding(orig_vocab_size: int, args) -> int:
    """Round the vocabulary up so each tensor-parallel rank holds an equal, aligned slice.

    Multiple = ``make_vocab_size_divisible_by * tensor_model_parallel_size``
    (defaults 128 and 1); GPT-2's 50,257 becomes 50,304. Prints the padding on rank 0.

    Raises ValueError if either factor is < 1.
    """
    divisible_by = getattr(args, "make_vocab_size_divisible_by", 128)
    tp_size = getattr(args, "tensor_model_parallel_size", 1)
    if divisible_by < 1 or tp_size < 1:
        raise ValueError(
            f"--make-vocab-size-divisible-by ({divisible_by}) and --tensor-model-parallel-size ({tp_size}) must be >= 1"
        )
    multiple = divisible_by * tp_size
    padded = int(math.ceil(orig_vocab_size / multiple)) * multiple
    if getattr(args, "rank", 0) == 0:
        write_line(f" > padded vocab (size: {orig_vocab_size}) with {padded - orig_vocab_size} dummy tokens "
                   f"(new size: {padded})")
    return padded


def build_tokenizer(args) -> MegatronTokenizer:
    """Build the tokenizer named by ``args.tokenizer_type`` and set ``args.padded_vocab_size``.

    ``args.padded_vocab_size`` is kept when already given, else computed by
    ``_vocab_size_with_padding``. Prints "> building {type} tokenizer ..." on rank 0.

    Raises:
        ValueError: ``--tokenizer-type`` is missing or not one of the supported types, or a flag
            the type needs (``--vocab-file``, ``--merge-file``, ``--tokenizer-model``, ``--vocab-size``,
            ``--tiktoken-pattern``) is missing, or a tokenizer cannot be loaded.
        ImportError: transformers (HuggingFaceTokenizer) or tiktoken (TikTokenizer) is not installed.
        FileNotFoundError: a tokenizer file does not exist (message names its flag).
    """
    tokenizer_type = getattr(args, "tokenizer_type", None)
    if getattr(args, "rank", 0) == 0:
        write_line(f"> building {tokenizer_type} tokenizer ...")
    vocab_file = getattr(args, "vocab_file", None)
    merge_file = getattr(args, "merge_file", None)
    tokenizer_model = getattr(args, "tokenizer_model", None)
    if tokenizer_type == "GPT2BPETokenizer":
        if vocab_file is None or merge_file is None:
            raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
        tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    elif tokenizer_type == "SentencePieceTokenizer":
        if tokenizer_model is None:
            raise ValueError("--tokenizer-type SentencePieceTokenizer needs --tokenizer-model")
        tokenizer = SentencePieceTokenizer(tokenizer_model, vocab_extra_ids=getattr(args, "vocab_extra_ids", 0))
    elif tokenizer_type == "GPTSentencePieceTokenizer":
        if tokenizer_model is None:
            raise ValueError("--tokenizer-type GPTSentencePieceTokenizer needs --tokenizer-model")
        tokenizer = GPTSentencePieceTokenizer(tokenizer_model)
    elif tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer directory "
                             "or Hugging Face name)")
        tokenizer = HuggingFaceTokenizer(
            tokenizer_model, trust_remote_code=getattr(args, "trust_remote_code", False),
            use_fast=getattr(args, "tokenizer_hf_use_fast", True),
            include_special_tokens=getattr(args, "tokenizer_hf_include_special_tokens", True),
        )
    elif tokenizer_type == "TikTokenizer":
        if tokenizer_model is None:
            raise ValueError("--tokenizer-type TikTokenizer needs --tokenizer-model (a tiktoken vocabulary file)")
        pattern = getattr(args, "tiktoken_pattern", None)
        if pattern not in ("v1", "v2"):
            raise ValueError(f"--tokenizer-type TikTokenizer needs --tiktoken-pattern v1 or v2, got {pattern}")
        tokenizer = TikTokenizer(
            tokenizer_model, pattern=pattern, vocab_size=getattr(args, "vocab_size", None),
            num_special_tokens=getattr(args, "tiktoken_num_special_tokens", 1000),
            special_tokens=getattr(args, "tokenizer_special_tokens", None)
            or getattr(args, "tiktoken_special_tokens", None),
        )
    elif tokenizer_type == "NullTokenizer":
        if getattr(args, "vocab_size", None) is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        tokenizer = NullTokenizer(
            args.vocab_size,
            eod_id=getattr(args, "null_tokenizer_eod_id", None),
            pad_id=getattr(args, "null_tokenizer_pad_id", -1),
        )
    elif tokenizer_type is None:
        raise ValueError(f"--tokenizer-type is required; supported: {', '.join(SUPPORTED_TOKENIZER_TYPES)}")
    else:
        raise ValueError(
            f"--tokenizer-type {tokenizer_type} is not supported by this framework; "
            f"supported: {', '.join(SUPPORTED_TOKENIZER_TYPES)}"
        )
    if getattr(args, "padded_vocab_size", None) is None:
        args.padded_vocab_size = _vocab_size_with_padding(tokenizer.vocab_size, args)
    return tokenizer
