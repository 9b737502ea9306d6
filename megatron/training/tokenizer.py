"""Megatron's tokenizer command-line flags and the factory that builds a tokenizer from a TokenizerConfig."""
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
from megatron.training.argument_utils import tokenizer_settings_from_args
from megatron.training.config.training_config import TokenizerConfig

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

# What each tokenizer type reads: (flag, dest). validate_args names the missing ones together.
TOKENIZER_FILES = {
    "GPT2BPETokenizer": (("--vocab-file", "vocab_file"), ("--merge-file", "merge_file")),
    "SentencePieceTokenizer": (("--tokenizer-model", "tokenizer_model"),),
    "GPTSentencePieceTokenizer": (("--tokenizer-model", "tokenizer_model"),),
    "HuggingFaceTokenizer": (("--tokenizer-model", "tokenizer_model"),),
    "TikTokenizer": (("--tokenizer-model", "tokenizer_model"),),
    "NullTokenizer": (("--vocab-size", "vocab_size"),),
}


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


def vocab_size_with_padding(orig_vocab_size: int, make_vocab_size_divisible_by: int = 128,
                            tensor_model_parallel_size: int = 1, log: bool = True) -> int:
    """Round the vocabulary up so each tensor-parallel rank holds an equal, aligned slice.

    Multiple = ``make_vocab_size_divisible_by * tensor_model_parallel_size``; GPT-2's 50,257 becomes
    50,304. Prints the padding when ``log`` (rank 0).

    Raises ValueError if either factor is < 1.
    """
    divisible_by, tp_size = make_vocab_size_divisible_by, tensor_model_parallel_size
    if divisible_by < 1 or tp_size < 1:
        raise ValueError(
            f"--make-vocab-size-divisible-by ({divisible_by}) and --tensor-model-parallel-size ({tp_size}) must be >= 1"
        )
    multiple = divisible_by * tp_size
    padded = int(math.ceil(orig_vocab_size / multiple)) * multiple
    if log:
        write_line(f" > padded vocab (size: {orig_vocab_size}) with {padded - orig_vocab_size} dummy tokens "
                   f"(new size: {padded})")
    return padded


def _vocab_size_with_padding(orig_vocab_size: int, args) -> int:
    """Megatron-LM's signature of :func:`vocab_size_with_padding`: the factors and the rank from ``args``
    (defaults 128, 1 and 0 where ``args`` lacks them)."""
    tokenizer, tp_size, rank = tokenizer_settings_from_args(args)
    return vocab_size_with_padding(orig_vocab_size, tokenizer.make_vocab_size_divisible_by, tp_size, log=rank == 0)


def build_tokenizer_from_config(config: TokenizerConfig, log: bool = True) -> MegatronTokenizer:
    """Build the tokenizer named by ``config.tokenizer_type`` (a TokenizerConfig). Prints
    "> building {type} tokenizer ..." when ``log`` (rank 0). The padded vocabulary is not computed here
    (:func:`vocab_size_with_padding`).

    Raises:
        ValueError: ``--tokenizer-type`` is missing or not one of the supported types, or a flag
            the type needs (``--vocab-file``, ``--merge-file``, ``--tokenizer-model``, ``--vocab-size``,
            ``--tiktoken-pattern``) is missing, or a tokenizer cannot be loaded.
        ImportError: transformers (HuggingFaceTokenizer) or tiktoken (TikTokenizer) is not installed.
        FileNotFoundError: a tokenizer file does not exist (message names its flag).
    """
    tokenizer_type = config.tokenizer_type
    if log:
        write_line(f"> building {tokenizer_type} tokenizer ...")
    vocab_file, merge_file, tokenizer_model = config.vocab_file, config.merge_file, config.tokenizer_model
    if tokenizer_type == "GPT2BPETokenizer":
        if vocab_file is None or merge_file is None:
            raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "SentencePieceTokenizer":
        if tokenizer_model is None:
            raise ValueError("--tokenizer-type SentencePieceTokenizer needs --tokenizer-model")
        return SentencePieceTokenizer(tokenizer_model, vocab_extra_ids=config.vocab_extra_ids)
    if tokenizer_type == "GPTSentencePieceTokenizer":
        if tokenizer_model is None:
            raise ValueError("--tokenizer-type GPTSentencePieceTokenizer needs --tokenizer-model")
        return GPTSentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer directory "
                             "or Hugging Face name)")
        return HuggingFaceTokenizer(
            tokenizer_model, trust_remote_code=config.trust_remote_code,
            use_fast=config.tokenizer_hf_use_fast,
            include_special_tokens=config.tokenizer_hf_include_special_tokens,
        )
    if tokenizer_type == "TikTokenizer":
        if tokenizer_model is None:
            raise ValueError("--tokenizer-type TikTokenizer needs --tokenizer-model (a tiktoken vocabulary file)")
        pattern = config.tiktoken_pattern
        if pattern not in ("v1", "v2"):
            raise ValueError(f"--tokenizer-type TikTokenizer needs --tiktoken-pattern v1 or v2, got {pattern}")
        return TikTokenizer(
            tokenizer_model, pattern=pattern, vocab_size=config.vocab_size,
            num_special_tokens=config.tiktoken_num_special_tokens,
            special_tokens=config.tokenizer_special_tokens or config.tiktoken_special_tokens,
        )
    if tokenizer_type == "NullTokenizer":
        if config.vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(config.vocab_size, eod_id=config.null_tokenizer_eod_id,
                             pad_id=config.null_tokenizer_pad_id)
    if tokenizer_type is None:
        raise ValueError(f"--tokenizer-type is required; supported: {', '.join(SUPPORTED_TOKENIZER_TYPES)}")
    raise ValueError(
        f"--tokenizer-type {tokenizer_type} is not supported by this framework; "
        f"supported: {', '.join(SUPPORTED_TOKENIZER_TYPES)}"
    )


def build_tokenizer(args) -> MegatronTokenizer:
    """Megatron-LM's entry point: build the tokenizer the tokenizer flags of ``args`` name and set
    ``args.padded_vocab_size`` (kept when already given, else :func:`vocab_size_with_padding`).

    Raises as :func:`build_tokenizer_from_config`.
    """
    config, tp_size, rank = tokenizer_settings_from_args(args)
    tokenizer = build_tokenizer_from_config(config, log=rank == 0)
    if config.padded_vocab_size is None:
        args.padded_vocab_size = vocab_size_with_padding(
            tokenizer.vocab_size, config.make_vocab_size_divisible_by, tp_size, log=rank == 0)
    return tokenizer
