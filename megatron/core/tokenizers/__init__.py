"""Tokenizers that turn text into the token ids Megatron trains on."""
from megatron.core.tokenizers.base import MegatronTokenizer
from megatron.core.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron.core.tokenizers.huggingface_tokenizer import HuggingFaceTokenizer
from megatron.core.tokenizers.null_tokenizer import NullTokenizer
from megatron.core.tokenizers.sentencepiece_tokenizer import GPTSentencePieceTokenizer, SentencePieceTokenizer
from megatron.core.tokenizers.tiktokenizer import TikTokenizer

__all__ = [
    "MegatronTokenizer",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "NullTokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
]
