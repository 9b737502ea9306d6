"""The GPTModel constructor settings that TransformerConfig does not hold (this project's addition).

``pretrain_gpt.py``'s ``model_provider`` passes these to ``GPTModel`` beside the ``TransformerConfig``.
Megatron-LM HEAD keeps them in ``megatron/training/models``' ``GPTModelConfig``, which wraps the
TransformerConfig; here the container's ``model`` stays the plain ``TransformerConfig`` (its pickles and
``__eq__`` unchanged), and these few settings get their own record. The vocabulary size is the
tokenizer's (``TokenizerConfig.padded_vocab_size``) and is not repeated here.
"""
from dataclasses import dataclass
from typing import Optional


@dataclass(kw_only=True)
class GPTModelProviderConfig:
    """Position embedding, output layer and loss settings of ``GPTModel`` (flag dests as field names)."""

    max_position_embeddings: Optional[int] = None
    """Derived: ``--seq-length`` for the table-free position encodings when not given."""
    position_embedding_type: str = "learned_absolute"
    """``rope`` once validated when ``--use-rotary-position-embeddings`` was given."""
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    rotary_seq_len_interpolation_factor: Optional[int] = None
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    untie_embeddings_and_output_weights: bool = False
    fp16_lm_cross_entropy: bool = False
